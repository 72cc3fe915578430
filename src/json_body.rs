//! JSON bodies that clients send, read into tollgate's types.
//!
//! Owns the words a client hears when its JSON body is wrong: where (the
//! body, or the path of the field at fault, such as `limits[0].window`)
//! and what, in tollgate's own sentences. The JSON library's error text
//! never reaches a client: its wording is the library's, changes with its
//! versions, and is no contract.
//!
//! Invariant: a [`Fault`]'s text is built only from the client's own
//! field names and positions and from the sentences below.

use std::fmt;

use serde::de::DeserializeOwned;
use serde_json::error::Category;

/// What is wrong with a JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// Where: `body` for the whole, else the path of the field at fault.
    pub field: String,
    /// What, in a short sentence.
    pub problem: String,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.problem)
    }
}

/// Reads `body` as a `T`. A body that reads costs no more than
/// `serde_json` alone: the path of a fault is traced only when there is
/// one, by reading the body again.
///
/// # Errors
/// A [`Fault`] when `body` is not JSON, or not a `T`.
pub fn read<T: DeserializeOwned>(body: &[u8]) -> Result<T, Fault> {
    serde_json::from_slice(body).map_err(|first| {
        let mut json = serde_json::Deserializer::from_slice(body);
        // A `T` read whole again failed for what follows it: the first
        // error says where.
        serde_path_to_error::deserialize::<_, T>(&mut json)
            .map_or_else(fault, |_| fault_of(String::new(), &first))
    })
}

/// Reads `body` as a `T` whose fields are `fields` (a flat object): a
/// fault then says whether the field at fault is not one of them or holds
/// a value it does not take.
///
/// # Errors
/// A [`Fault`] when `body` is not JSON, or not a `T`.
pub fn read_fields<T: DeserializeOwned>(body: &[u8], fields: &[&str]) -> Result<T, Fault> {
    read(body).map_err(|mut fault| {
        if fault.field != "body" {
            fault.problem = if fields.contains(&fault.field.as_str()) {
                "holds a value this field does not take".to_owned()
            } else {
                format!("is not a field here (the fields: {})", fields.join(", "))
            };
        }
        fault
    })
}

/// Reads an already parsed `value` as a `T`.
///
/// # Errors
/// A [`Fault`] when `value` is not a `T`.
pub fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, Fault> {
    serde_path_to_error::deserialize(value).map_err(fault)
}

/// The fault a JSON library error names.
fn fault(e: serde_path_to_error::Error<serde_json::Error>) -> Fault {
    let path = e.path().to_string();
    fault_of(path, e.inner())
}

/// The fault of `e`, met at `path` (`.` or empty: the whole body).
pub fn fault_of(path: String, e: &serde_json::Error) -> Fault {
    let whole = path.is_empty() || path == ".";
    let at = || format!("at line {}, column {}", e.line(), e.column());
    let (field, problem) = match e.classify() {
        Category::Syntax => ("body".to_owned(), format!("is not valid JSON {}", at())),
        Category::Eof => (
            "body".to_owned(),
            format!("ends before its JSON does {}", at()),
        ),
        Category::Io => ("body".to_owned(), "could not be read".to_owned()),
        Category::Data if whole => (
            "body".to_owned(),
            "is not an object with the fields this call takes (one is missing or \
             named twice, or the value is not an object)"
                .to_owned(),
        ),
        Category::Data => (
            path,
            "is not a field this call takes, or holds a value it does not take".to_owned(),
        ),
    };
    Fault { field, problem }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Probe {
        name: String,
        #[serde(default)]
        items: Vec<Item>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Item {
        size: u32,
    }

    fn fault_of_body(body: &str) -> Fault {
        read::<Probe>(body.as_bytes()).unwrap_err()
    }

    #[test]
    fn a_fault_names_where_in_tollgates_words() {
        let probe = read::<Probe>(br#"{"name": "a", "items": [{"size": 3}]}"#).unwrap();
        assert_eq!((probe.name.as_str(), probe.items[0].size), ("a", 3));
        let syntax = fault_of_body("not json");
        assert_eq!(syntax.field, "body");
        assert_eq!(syntax.problem, "is not valid JSON at line 1, column 2");
        assert_eq!(fault_of_body(r#"{"name": "a""#).field, "body");
        assert!(
            fault_of_body(r#"{"name": "a""#)
                .problem
                .starts_with("ends before")
        );
        assert_eq!(fault_of_body(r#"{"nmae": "a"}"#).field, "nmae");
        assert_eq!(fault_of_body(r#"{"name": 5}"#).field, "name");
        let nested = fault_of_body(r#"{"name": "a", "items": [{"size": -1}]}"#);
        assert_eq!(nested.field, "items[0].size");
        assert_eq!(fault_of_body("{}").field, "body");
        assert_eq!(fault_of_body(r#"{"name": "a"} x"#).field, "body");
    }

    #[test]
    fn a_flat_body_tells_an_unknown_field_from_a_bad_value() {
        let fields = ["name", "items"];
        let read = |body: &str| read_fields::<Probe>(body.as_bytes(), &fields).unwrap_err();
        assert_eq!(
            read(r#"{"nmae": "a"}"#).to_string(),
            "nmae: is not a field here (the fields: name, items)"
        );
        assert_eq!(
            read(r#"{"name": 5}"#).to_string(),
            "name: holds a value this field does not take"
        );
        assert_eq!(read("[").field, "body");
    }

    #[test]
    fn no_library_text_reaches_the_words() {
        for body in ["not json", r#"{"nmae": "a"}"#, r#"{"name": 5}"#, "{}", "[1"] {
            let text = fault_of_body(body).to_string();
            for library in ["unknown field", "invalid type", "missing field", "expected"] {
                assert!(!text.contains(library), "{body}: {text}");
            }
        }
    }
}
