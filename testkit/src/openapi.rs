//! The sidecar's OpenAPI document (`sidecar/openapi.yaml`) as a check on real
//! answers: every answer a test's [`HttpClient`](crate::HttpClient) receives from a
//! documented route must have a documented status, the headers that response
//! documents (and no undocumented `Retry-After` or `Dropgate-Path`), and a body the
//! response's schema accepts. The schemas are checked by the `jsonschema` crate
//! (JSON Schema 2020-12, formats included); finding the operation and the response
//! is done here.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use http::{HeaderMap, Method, StatusCode};
use serde_json::Value;

/// The document, as the repository has it.
pub const DOCUMENT: &str = include_str!("../../sidecar/openapi.yaml");

/// The headers the API gives meaning to: present only where documented.
const MEANINGFUL_HEADERS: [&str; 2] = ["retry-after", "dropgate-path"];

/// The document, parsed.
pub fn document() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(|| serde_norway::from_str(DOCUMENT).expect("sidecar/openapi.yaml is YAML"))
}

/// The document's operations, compiled once.
pub fn contract() -> &'static Contract {
    static CONTRACT: OnceLock<Contract> = OnceLock::new();
    CONTRACT.get_or_init(|| Contract::compile(document()).expect("sidecar/openapi.yaml compiles"))
}

#[derive(Debug)]
pub struct Contract {
    operations: Vec<Operation>,
}

#[derive(Debug)]
struct Operation {
    method: Method,
    template: String,
    /// The template's segments: `Some(literal)` or `None` for a parameter.
    segments: Vec<Option<String>>,
    responses: BTreeMap<u16, Expected>,
}

#[derive(Debug)]
struct Expected {
    /// The JSON body's schema (None: not JSON, such as /metrics).
    body: Option<jsonschema::Validator>,
    headers: BTreeMap<String, ExpectedHeader>,
}

#[derive(Debug)]
struct ExpectedHeader {
    required: bool,
    schema: jsonschema::Validator,
}

/// Follows a local `$ref` (`#/components/...`) to what it names.
fn resolve<'a>(doc: &'a Value, node: &'a Value) -> Result<&'a Value, String> {
    match node.get("$ref").and_then(Value::as_str) {
        Some(reference) => {
            let pointer = reference
                .strip_prefix('#')
                .ok_or_else(|| format!("{reference}: only local references are used"))?;
            let target = doc
                .pointer(pointer)
                .ok_or_else(|| format!("{reference} names nothing"))?;
            resolve(doc, target)
        }
        None => Ok(node),
    }
}

/// A validator of `schema`, whose `$ref`s point into the document's components.
fn compile_schema(doc: &Value, schema: &Value) -> Result<jsonschema::Validator, String> {
    let wrapped = serde_json::json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "allOf": [schema],
        "components": doc["components"],
    });
    jsonschema::options()
        .should_validate_formats(true)
        .build(&wrapped)
        .map_err(|e| format!("schema {schema}: {e}"))
}

impl Contract {
    fn compile(doc: &Value) -> Result<Self, String> {
        let paths = doc["paths"].as_object().ok_or("no paths")?;
        let mut operations = Vec::new();
        for (template, item) in paths {
            let item = item.as_object().ok_or("a path item is not an object")?;
            for (method, operation) in item {
                // A path item also holds its `parameters`, `summary`, ...
                let method = match method.as_str() {
                    "get" => Method::GET,
                    "post" => Method::POST,
                    "put" => Method::PUT,
                    "patch" => Method::PATCH,
                    "delete" => Method::DELETE,
                    _ => continue,
                };
                let responses = operation["responses"]
                    .as_object()
                    .ok_or_else(|| format!("{method} {template}: no responses"))?;
                let mut expected = BTreeMap::new();
                for (status, response) in responses {
                    let status: u16 = status
                        .parse()
                        .map_err(|_| format!("{method} {template}: status {status}"))?;
                    let response = resolve(doc, response)?;
                    let body = match response.pointer("/content/application~1json/schema") {
                        Some(schema) => Some(compile_schema(doc, schema)?),
                        None => None,
                    };
                    let mut headers = BTreeMap::new();
                    if let Some(documented) = response["headers"].as_object() {
                        for (name, header) in documented {
                            let header = resolve(doc, header)?;
                            headers.insert(
                                name.to_ascii_lowercase(),
                                ExpectedHeader {
                                    required: header["required"].as_bool().unwrap_or(false),
                                    schema: compile_schema(doc, &header["schema"])?,
                                },
                            );
                        }
                    }
                    expected.insert(status, Expected { body, headers });
                }
                let segments = template
                    .trim_start_matches('/')
                    .split('/')
                    .map(|s| (!s.starts_with('{')).then(|| s.to_string()))
                    .collect();
                operations.push(Operation {
                    method,
                    template: template.clone(),
                    segments,
                    responses: expected,
                });
            }
        }
        Ok(Self { operations })
    }

    /// The documented operations as `METHOD /template`.
    pub fn operations(&self) -> Vec<String> {
        self.operations
            .iter()
            .map(|op| format!("{} {}", op.method, op.template))
            .collect()
    }

    /// The statuses documented for `METHOD /template` (empty when it is not).
    pub fn statuses(&self, operation: &str) -> Vec<u16> {
        self.operations
            .iter()
            .find(|op| format!("{} {}", op.method, op.template) == operation)
            .map(|op| op.responses.keys().copied().collect())
            .unwrap_or_default()
    }

    /// The documented operation `METHOD /template` that a request to `path` is
    /// (its query left out), if any.
    pub fn operation_of(&self, method: &Method, path: &str) -> Option<String> {
        self.find(method, path)
            .map(|op| format!("{} {}", op.method, op.template))
    }

    fn find(&self, method: &Method, path: &str) -> Option<&Operation> {
        let path = path.split('?').next().unwrap_or(path);
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        self.operations.iter().find(|op| {
            op.method == method
                && op.segments.len() == segments.len()
                && op.segments.iter().zip(&segments).all(|(t, s)| match t {
                    Some(literal) => literal == s,
                    None => true,
                })
        })
    }

    /// Checks an answer to `method path` against the document. Ok when it conforms
    /// or the request is no documented operation (an unknown route, a method the
    /// route does not take); otherwise what differs.
    pub fn check(
        &self,
        method: &Method,
        path: &str,
        status: StatusCode,
        headers: &HeaderMap,
        text: &str,
    ) -> Result<(), String> {
        let Some(op) = self.find(method, path) else {
            return Ok(());
        };
        let at = format!(
            "{method} {path} ({} {}) answered {status}",
            op.method, op.template
        );
        let expected = op.responses.get(&status.as_u16()).ok_or_else(|| {
            format!(
                "{at}: the document has no {} response for it: {text}",
                status.as_u16()
            )
        })?;
        for (name, header) in &expected.headers {
            match headers.get(name.as_str()) {
                None if header.required => return Err(format!("{at}: no {name} header")),
                None => {}
                Some(value) => {
                    let value = value
                        .to_str()
                        .map_err(|_| format!("{at}: header {name} is not text"))?;
                    let json = value
                        .parse::<i64>()
                        .map(Value::from)
                        .unwrap_or_else(|_| Value::from(value));
                    if let Some(error) = header.schema.iter_errors(&json).next() {
                        return Err(format!("{at}: header {name}: {value}: {error}"));
                    }
                }
            }
        }
        for name in MEANINGFUL_HEADERS {
            if headers.contains_key(name) && !expected.headers.contains_key(name) {
                return Err(format!("{at}: header {name} is not documented for it"));
            }
        }
        if let Some(schema) = &expected.body {
            let body: Value = serde_json::from_str(text)
                .map_err(|e| format!("{at}: the body is not JSON ({e}): {text}"))?;
            let errors: Vec<String> = schema
                .iter_errors(&body)
                .map(|e| format!("{} at {}", e, e.instance_path()))
                .collect();
            if !errors.is_empty() {
                return Err(format!(
                    "{at}: the body does not match the document: {}\nbody: {text}",
                    errors.join("; ")
                ));
            }
        }
        Ok(())
    }
}

/// The events' JSON Schema (`sidecar/events.schema.json`), as the repository has it.
pub const EVENT_SCHEMA: &str = include_str!("../../sidecar/events.schema.json");

/// Checks one event's payload (the `payload` field of a stream entry) against the
/// events' schema: Ok, or what differs.
pub fn check_event(payload: &Value) -> Result<(), String> {
    static SCHEMA: OnceLock<jsonschema::Validator> = OnceLock::new();
    let schema = SCHEMA.get_or_init(|| {
        let schema: Value =
            serde_json::from_str(EVENT_SCHEMA).expect("sidecar/events.schema.json is JSON");
        jsonschema::options()
            .should_validate_formats(true)
            .build(&schema)
            .expect("sidecar/events.schema.json compiles")
    });
    let errors: Vec<String> = schema
        .iter_errors(payload)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("{}: {payload}", errors.join("; ")))
    }
}
