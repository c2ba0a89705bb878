//! Request bodies and path segments, checked field by field so that every refusal
//! names what is wrong. Nothing reaches Redis before it passed here.

use serde_json::{Map, Value};

use dropgate_api::{MAX_ID_BYTES, MAX_QUANTITY};

/// A refusal of bad input: the sentence for the `message` field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The body of `POST /v1/drops/{drop}/reservations`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserve {
    pub key: String,
    pub user: String,
    pub quantity: i64,
    /// Which variant of the drop (required for a drop with variants, refused for
    /// one without: the service checks it against the drop's config).
    pub variant: Option<String>,
}

impl Reserve {
    /// The reserve as the gates are asked it.
    pub fn ask(&self) -> crate::reservation::Ask<'_> {
        crate::reservation::Ask {
            key: &self.key,
            user: &self.user,
            quantity: self.quantity,
            variant: self.variant.as_deref(),
        }
    }

    pub fn parse(body: &[u8]) -> Result<Self, Invalid> {
        let mut fields = Fields::parse(body, &["key", "user", "quantity", "variant"])?;
        Ok(Self {
            key: fields.id("key")?,
            user: fields.id("user")?,
            quantity: fields.int("quantity", 1, MAX_QUANTITY)?,
            variant: fields.variant("variant")?,
        })
    }
}

/// A JSON object body whose fields are taken one by one.
pub struct Fields {
    map: Map<String, Value>,
}

impl Fields {
    /// Parses `body` as a JSON object with no fields outside `allowed`.
    pub fn parse(body: &[u8], allowed: &[&str]) -> Result<Self, Invalid> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| Invalid(format!("the body is not valid JSON: {e}")))?;
        if !value.is_object() {
            return Err(Invalid("the body must be a JSON object".into()));
        }
        // serde_json keeps the last of two equal keys; a body that says two things
        // is refused instead of read as one of them.
        let UniqueKeys(map) = serde_json::from_slice(body)
            .map_err(|e| Invalid(format!("the body is not valid JSON: {e}")))?;
        let mut unknown: Vec<&str> = map
            .keys()
            .map(String::as_str)
            .filter(|k| !allowed.contains(k))
            .collect();
        unknown.sort_unstable();
        if let Some(first) = unknown.first() {
            return Err(Invalid(format!(
                "unknown field `{first}`: the fields are {}",
                allowed.join(", ")
            )));
        }
        Ok(Self { map })
    }

    fn take(&mut self, field: &str) -> Result<Value, Invalid> {
        self.map
            .remove(field)
            .ok_or_else(|| Invalid(format!("missing field `{field}`")))
    }

    /// A required identifier: a string of 1 to 256 bytes.
    pub fn id(&mut self, field: &str) -> Result<String, Invalid> {
        match self.take(field)? {
            Value::String(s) => id(field, &s).map(|()| s),
            other => Err(Invalid(format!(
                "`{field}` must be a string, not {}",
                kind(&other)
            ))),
        }
    }

    /// An optional variant name (`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`).
    pub fn variant(&mut self, field: &str) -> Result<Option<String>, Invalid> {
        match self.map.remove(field) {
            None => Ok(None),
            Some(Value::String(s)) if dropgate_api::drop::is_variant_name(&s) => Ok(Some(s)),
            Some(Value::String(_)) => Err(Invalid(format!(
                "`{field}` must be a variant name: 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit"
            ))),
            Some(other) => Err(Invalid(format!(
                "`{field}` must be a string, not {}",
                kind(&other)
            ))),
        }
    }

    /// A required integer in `min..=max`. Floats (`1.0` too), booleans and strings
    /// are refused: a quantity is counted, never rounded.
    pub fn int(&mut self, field: &str, min: i64, max: i64) -> Result<i64, Invalid> {
        let value = self.take(field)?;
        let out_of_range = || Invalid(format!("`{field}` must be an integer from {min} to {max}"));
        match &value {
            Value::Number(n) if n.is_i64() || n.is_u64() => {
                let n = n.as_i64().ok_or_else(out_of_range)?;
                if (min..=max).contains(&n) {
                    Ok(n)
                } else {
                    Err(out_of_range())
                }
            }
            _ => Err(Invalid(format!(
                "`{field}` must be an integer from {min} to {max}, not {}",
                kind(&value)
            ))),
        }
    }
}

/// A JSON object whose keys are each given once.
struct UniqueKeys(Map<String, Value>);

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UniqueKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut access: A,
            ) -> Result<UniqueKeys, A::Error> {
                let mut map = Map::new();
                while let Some((key, value)) = access.next_entry::<String, Value>()? {
                    if map.contains_key(&key) {
                        return Err(serde::de::Error::custom(format!(
                            "the field `{key}` is given twice"
                        )));
                    }
                    map.insert(key, value);
                }
                Ok(UniqueKeys(map))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

/// Checks an identifier taken from a body or a path: not empty, at most 256 bytes,
/// no control characters (NUL among them: PostgreSQL refuses it in text, SQLite
/// keeps it, and logs and headers mangle them all).
pub fn id(field: &str, value: &str) -> Result<(), Invalid> {
    if value.is_empty() {
        Err(Invalid(format!("`{field}` must not be empty")))
    } else if let Some((at, c)) = value.char_indices().find(|(_, c)| c.is_control()) {
        Err(Invalid(format!(
            "`{field}` must not contain control characters (U+{:04X} at byte {at})",
            u32::from(c)
        )))
    } else if value.len() > MAX_ID_BYTES {
        Err(Invalid(format!(
            "`{field}` must be at most {MAX_ID_BYTES} bytes, not {}",
            value.len()
        )))
    } else {
        Ok(())
    }
}

/// A percent-decoded path segment, checked as an identifier.
pub fn path_id(field: &str, raw: &str) -> Result<String, Invalid> {
    let decoded = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| Invalid(format!("`{field}` in the path is not UTF-8")))?
        .into_owned();
    id(field, &decoded)?;
    Ok(decoded)
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a fractional number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(body: &str) -> String {
        Reserve::parse(body.as_bytes()).expect_err(body).0
    }

    #[test]
    fn accepts_a_well_formed_body() {
        assert_eq!(
            Reserve::parse(br#"{"key":"k","user":"u","quantity":2147483647}"#),
            Ok(Reserve {
                key: "k".into(),
                user: "u".into(),
                quantity: 2147483647,
                variant: None,
            })
        );
        assert_eq!(
            Reserve::parse(br#"{"key":"k","user":"u","quantity":1,"variant":"US-9.5_w"}"#)
                .map(|r| r.variant),
            Ok(Some("US-9.5_w".into()))
        );
    }

    #[test]
    fn a_variant_must_be_a_variant_name() {
        for bad in [
            r#""""#,
            r#""-9""#,
            r#""US 9""#,
            r#""US=9""#,
            r#""US,9""#,
            r#"9"#,
            r#"null"#,
        ] {
            let body = format!(r#"{{"key":"k","user":"u","quantity":1,"variant":{bad}}}"#);
            let refused = refusal(&body);
            assert!(refused.contains("`variant`"), "{body}: {refused}");
        }
        let long = format!(
            r#"{{"key":"k","user":"u","quantity":1,"variant":"{}"}}"#,
            "v".repeat(64)
        );
        assert!(refusal(&long).contains("`variant`"));
    }

    #[test]
    fn every_refusal_names_its_field() {
        let long = "x".repeat(257);
        let table: Vec<(String, &str)> = vec![
            ("{".into(), "not valid JSON"),
            ("[1]".into(), "JSON object"),
            (
                r#"{"key":"k","user":"u","quantity":1,"extra":1}"#.into(),
                "`extra`",
            ),
            (
                r#"{"key":"k","user":"u"}"#.into(),
                "missing field `quantity`",
            ),
            (r#"{"user":"u","quantity":1}"#.into(), "missing field `key`"),
            (
                r#"{"key":"k","user":"u","quantity":true}"#.into(),
                "`quantity`",
            ),
            (
                r#"{"key":"k","user":"u","quantity":1.0}"#.into(),
                "`quantity`",
            ),
            (
                r#"{"key":"k","user":"u","quantity":1.5}"#.into(),
                "`quantity`",
            ),
            (
                r#"{"key":"k","user":"u","quantity":"1"}"#.into(),
                "`quantity`",
            ),
            (
                r#"{"key":"k","user":"u","quantity":0}"#.into(),
                "`quantity`",
            ),
            (
                r#"{"key":"k","user":"u","quantity":-1}"#.into(),
                "`quantity`",
            ),
            (
                r#"{"key":"k","user":"u","quantity":2147483648}"#.into(),
                "`quantity`",
            ),
            (
                r#"{"key":"k","user":"u","quantity":1e3}"#.into(),
                "`quantity`",
            ),
            (
                r#"{"key":"k","user":"u","quantity":null}"#.into(),
                "`quantity`",
            ),
            (
                r#"{"key":"","user":"u","quantity":1}"#.into(),
                "`key` must not be empty",
            ),
            (
                r#"{"key":"k","user":"","quantity":1}"#.into(),
                "`user` must not be empty",
            ),
            (
                r#"{"key":7,"user":"u","quantity":1}"#.into(),
                "`key` must be a string",
            ),
            (
                format!(r#"{{"key":"{long}","user":"u","quantity":1}}"#),
                "`key` must be at most 256",
            ),
            (
                format!(r#"{{"key":"k","user":"{long}","quantity":1}}"#),
                "`user` must be at most 256",
            ),
            (
                r#"{"key":"k\u0000","user":"u","quantity":1}"#.into(),
                "`key` must not contain control characters (U+0000 at byte 1)",
            ),
            (
                r#"{"key":"k","user":"u\n","quantity":1}"#.into(),
                "`user` must not contain control characters",
            ),
            (
                r#"{"key":"k","user":"u","quantity":1,"quantity":5}"#.into(),
                "the field `quantity` is given twice",
            ),
        ];
        for (body, want) in table {
            let got = refusal(&body);
            assert!(got.contains(want), "{body}: {got}");
        }
    }

    #[test]
    fn path_segments_are_decoded_then_checked() {
        assert_eq!(path_id("key", "order%2F1"), Ok("order/1".into()));
        assert!(path_id("key", "%FF").is_err());
        assert!(path_id("key", &"a".repeat(257)).is_err());
        assert!(path_id("key", "a%00b").is_err(), "a decoded NUL");
    }
}
