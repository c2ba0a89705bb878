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

/// The optional body of a reservation's confirm and cancel: `{"user"}`, the buyer
/// the caller acts for, and for a confirm `{"quantity"}`, the units it keeps (a
/// partial confirm). Without a body the key alone decides, and a confirm keeps all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SettleAs {
    pub user: Option<String>,
    pub quantity: Option<i64>,
}

impl SettleAs {
    /// A cancel's body: `{"user"}` at most.
    pub fn parse(body: &[u8]) -> Result<Self, Invalid> {
        Self::parse_fields(body, &["user"])
    }

    /// A confirm's body: `{"user", "quantity"}`, both optional.
    pub fn parse_confirm(body: &[u8]) -> Result<Self, Invalid> {
        Self::parse_fields(body, &["user", "quantity"])
    }

    fn parse_fields(body: &[u8], known: &[&str]) -> Result<Self, Invalid> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self::default());
        }
        let mut fields = Fields::parse(body, known)?;
        Ok(Self {
            user: fields.optional_id("user")?,
            quantity: fields.optional_int("quantity", 1, MAX_QUANTITY)?,
        })
    }
}

/// The body of a hold's extension: `{"expiresAt"}`, the deadline asked for (RFC
/// 3339 with an offset), and optionally `{"user"}`, the buyer the caller acts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtendTo {
    pub until_ms: i64,
    pub user: Option<String>,
}

impl ExtendTo {
    pub fn parse(body: &[u8]) -> Result<Self, Invalid> {
        let mut fields = Fields::parse(body, &["expiresAt", "user"])?;
        Ok(Self {
            until_ms: fields.time_ms("expiresAt")?,
            user: fields.optional_id("user")?,
        })
    }
}

/// Most lines a cart may have, as sent (before lines are added up).
pub const MAX_CART_LINES: usize = 20;

/// How a cart is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CartMode {
    /// Every line or none.
    All,
    /// Every line that fits; at least one.
    Available,
}

impl CartMode {
    pub fn as_str(self) -> &'static str {
        match self {
            CartMode::All => "all",
            CartMode::Available => "available",
        }
    }
}

/// One line of a cart: units of a drop (and variant).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CartLine {
    pub drop: String,
    pub variant: Option<String>,
    pub quantity: i64,
}

/// The body of `POST /v1/carts`, its lines added up per drop and variant and put
/// in order by drop, then variant: the same lines in another order are the same
/// cart (a retry that lists them otherwise is not a reused key), and line `n` is
/// the same line whichever order a retry sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CartReserve {
    pub key: String,
    pub user: String,
    pub lines: Vec<CartLine>,
    pub mode: CartMode,
}

impl CartReserve {
    pub fn parse(body: &[u8]) -> Result<Self, Invalid> {
        let mut fields = Fields::parse(body, &["key", "user", "lines", "mode"])?;
        let key = fields.id("key")?;
        // Each line is a reservation keyed `<key>:<n>`, itself an identifier.
        let longest = MAX_ID_BYTES - 3;
        if key.len() > longest {
            return Err(Invalid(format!(
                "`key` must be at most {longest} bytes for a cart (its lines are keyed `<key>:<n>`), not {}",
                key.len()
            )));
        }
        let user = fields.id("user")?;
        let mode = match fields.word("mode", &["all", "available"])? {
            Some("available") => CartMode::Available,
            _ => CartMode::All,
        };
        let mut lines: Vec<CartLine> = Vec::new();
        for mut line in fields.objects("lines", MAX_CART_LINES, &["drop", "variant", "quantity"])? {
            let drop = line.id("drop")?;
            let variant = line.variant("variant")?;
            let quantity = line.int("quantity", 1, MAX_QUANTITY)?;
            match lines
                .iter_mut()
                .find(|l| l.drop == drop && l.variant == variant)
            {
                Some(same) => {
                    same.quantity += quantity;
                    if same.quantity > MAX_QUANTITY {
                        return Err(Invalid(format!(
                            "the lines of drop {drop}{} add up to {} units, more than {MAX_QUANTITY}",
                            variant.map(|v| format!(" variant {v}")).unwrap_or_default(),
                            same.quantity
                        )));
                    }
                }
                None => lines.push(CartLine {
                    drop,
                    variant,
                    quantity,
                }),
            }
        }
        lines.sort_by(|a, b| (&a.drop, &a.variant).cmp(&(&b.drop, &b.variant)));
        Ok(Self {
            key,
            user,
            lines,
            mode,
        })
    }

    /// The key of line `n` (from 1): a reservation of the line's drop.
    pub fn line_key(&self, n: usize) -> String {
        line_key(&self.key, n)
    }

    /// What the cart asks, as canonical JSON: a retry must ask the same.
    pub fn terms(&self) -> String {
        serde_json::json!({"mode": self.mode.as_str(), "lines": self.lines}).to_string()
    }
}

/// The key of line `n` (from 1) of cart `cart`.
pub fn line_key(cart: &str, n: usize) -> String {
    format!("{cart}:{n}")
}

/// A JSON object body whose fields are taken one by one.
pub struct Fields {
    map: Map<String, Value>,
    /// How the object's fields are named in refusals: `` for a body,
    /// `lines[2].` for an element of an array.
    prefix: String,
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
        let Strict(value) = serde_json::from_slice(body)
            .map_err(|e| Invalid(format!("the body is not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(Invalid("the body must be a JSON object".into()));
        };
        Self::of(map, String::new(), allowed)
    }

    /// The fields of `map`, named with `prefix`, none outside `allowed`.
    fn of(map: Map<String, Value>, prefix: String, allowed: &[&str]) -> Result<Self, Invalid> {
        let mut unknown: Vec<&str> = map
            .keys()
            .map(String::as_str)
            .filter(|k| !allowed.contains(k))
            .collect();
        unknown.sort_unstable();
        if let Some(first) = unknown.first() {
            return Err(Invalid(format!(
                "unknown field `{prefix}{first}`: the fields are {}",
                allowed.join(", ")
            )));
        }
        Ok(Self { map, prefix })
    }

    /// How `field` is named in a refusal.
    fn name(&self, field: &str) -> String {
        format!("{}{field}", self.prefix)
    }

    fn take(&mut self, field: &str) -> Result<Value, Invalid> {
        self.map
            .remove(field)
            .ok_or_else(|| Invalid(format!("missing field `{}`", self.name(field))))
    }

    /// A required instant, RFC 3339 with an offset (`2026-12-01T10:00:00Z`), as ms
    /// since the epoch; one before the epoch is refused.
    pub fn time_ms(&mut self, field: &str) -> Result<i64, Invalid> {
        let value = self.take(field)?;
        let name = self.name(field);
        let refused = || {
            Invalid(format!(
                "`{name}` must be an RFC 3339 time with an offset, such as 2026-12-01T10:00:00Z"
            ))
        };
        match value {
            Value::String(s) => s
                .parse::<jiff::Timestamp>()
                .map(|t| t.as_millisecond())
                .ok()
                .filter(|ms| *ms >= 0)
                .ok_or_else(refused),
            other => Err(Invalid(format!(
                "`{name}` must be an RFC 3339 time string, not {}",
                kind(&other)
            ))),
        }
    }

    /// A required array of 1 to `max` objects, each with fields from `allowed`.
    pub fn objects(
        &mut self,
        field: &str,
        max: usize,
        allowed: &[&str],
    ) -> Result<Vec<Fields>, Invalid> {
        let name = self.name(field);
        let items = match self.take(field)? {
            Value::Array(items) => items,
            other => {
                return Err(Invalid(format!(
                    "`{name}` must be an array, not {}",
                    kind(&other)
                )));
            }
        };
        if items.is_empty() || items.len() > max {
            return Err(Invalid(format!(
                "`{name}` must hold 1 to {max} entries, not {}",
                items.len()
            )));
        }
        items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::Object(map) => Fields::of(map, format!("{name}[{i}]."), allowed),
                other => Err(Invalid(format!(
                    "`{name}[{i}]` must be an object, not {}",
                    kind(&other)
                ))),
            })
            .collect()
    }

    /// An optional string that must be one of `words`.
    pub fn word(
        &mut self,
        field: &str,
        words: &[&'static str],
    ) -> Result<Option<&'static str>, Invalid> {
        let name = self.name(field);
        match self.map.remove(field) {
            None => Ok(None),
            Some(Value::String(s)) => words
                .iter()
                .find(|w| **w == s)
                .copied()
                .map(Some)
                .ok_or_else(|| {
                    Invalid(format!(
                        "`{name}` must be one of {}, not {s:?}",
                        words.join(", ")
                    ))
                }),
            Some(other) => Err(Invalid(format!(
                "`{name}` must be a string, not {}",
                kind(&other)
            ))),
        }
    }

    /// A required identifier: a string of 1 to 256 bytes.
    pub fn id(&mut self, field: &str) -> Result<String, Invalid> {
        let name = self.name(field);
        match self.take(field)? {
            Value::String(s) => id(&name, &s).map(|()| s),
            other => Err(Invalid(format!(
                "`{name}` must be a string, not {}",
                kind(&other)
            ))),
        }
    }

    /// An optional identifier: when given, a string of 1 to 256 bytes.
    pub fn optional_id(&mut self, field: &str) -> Result<Option<String>, Invalid> {
        if self.map.contains_key(field) {
            self.id(field).map(Some)
        } else {
            Ok(None)
        }
    }

    /// An optional variant name (`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`).
    pub fn variant(&mut self, field: &str) -> Result<Option<String>, Invalid> {
        let value = self.map.remove(field);
        let field = self.name(field);
        match value {
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

    /// An optional integer: when given, in `min..=max` as [`Fields::int`] wants it.
    pub fn optional_int(
        &mut self,
        field: &str,
        min: i64,
        max: i64,
    ) -> Result<Option<i64>, Invalid> {
        if self.map.contains_key(field) {
            self.int(field, min, max).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A required integer in `min..=max`. Floats (`1.0` too), booleans and strings
    /// are refused: a quantity is counted, never rounded.
    pub fn int(&mut self, field: &str, min: i64, max: i64) -> Result<i64, Invalid> {
        let value = self.take(field)?;
        let field = self.name(field);
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

/// A JSON value whose objects, at every depth, give each key once.
struct Strict(Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(item)) = access.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let mut map = Map::new();
        while let Some((key, Strict(value))) = access.next_entry::<String, Strict>()? {
            if map.contains_key(&key) {
                return Err(serde::de::Error::custom(format!(
                    "the field `{key}` is given twice"
                )));
            }
            map.insert(key, value);
        }
        Ok(Value::Object(map))
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

/// The query of a buyer's look-up (`?user=U`): its one parameter, decoded (`+` is a
/// space) and checked as an identifier; anything else in the query is refused.
pub fn buyer_query(raw: &str) -> Result<String, Invalid> {
    let mut user = None;
    for pair in raw.split('&').filter(|pair| !pair.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if name != "user" {
            return Err(Invalid(format!(
                "unknown query parameter `{name}`: a look-up by buyer takes `user` only"
            )));
        }
        if user.is_some() {
            return Err(Invalid("query parameter `user` is given twice".into()));
        }
        let value = value.replace('+', " ");
        let decoded = percent_encoding::percent_decode_str(&value)
            .decode_utf8()
            .map_err(|_| Invalid("query parameter `user` is not UTF-8".into()))?
            .into_owned();
        id("user", &decoded)?;
        user = Some(decoded);
    }
    user.ok_or_else(|| {
        Invalid(
            "query parameter `user` is required: GET /v1/drops/{drop}/reservations?user=U".into(),
        )
    })
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
