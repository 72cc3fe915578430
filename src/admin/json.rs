//! Admin request bodies as JSON that says one thing.
//!
//! Owns how an admin body becomes a [`Value`]: like `serde_json`, except
//! that an object naming a key twice, at any depth, is refused instead of
//! keeping the last copy, as `POST /v1/check` refuses it. Two copies of
//! `capacity` would otherwise let whatever wrote the body, or a proxy that
//! rewrote part of it, decide which limit is stored.

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::json_body::{self, Fault};

/// Builds a [`Value`] whose objects name each key once; the first key
/// named twice is kept in `twice`, for the fault to name it.
#[derive(Clone, Copy)]
struct Strict<'a> {
    /// The key named twice, once met.
    twice: &'a RefCell<Option<String>>,
}

impl<'de> DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
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
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut list = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            list.push(item);
        }
        Ok(Value::Array(list))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                *self.twice.borrow_mut() = Some(key);
                return Err(de::Error::custom("a key comes twice"));
            }
            let value = map.next_value_seed(self)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// Parses `body` as JSON whose objects name every key once.
///
/// # Errors
/// A [`Fault`] naming where the JSON is malformed, or the key named twice
/// (with the path of its object).
pub(super) fn parse(body: &[u8]) -> Result<Value, Fault> {
    let twice = RefCell::new(None);
    let mut track = serde_path_to_error::Track::new();
    let mut json = serde_json::Deserializer::from_slice(body);
    let parsed = Strict { twice: &twice }
        .deserialize(serde_path_to_error::Deserializer::new(
            &mut json, &mut track,
        ))
        .and_then(|value| json.end().map(|()| value));
    parsed.map_err(|e| {
        let path = track.path().to_string();
        match twice.take() {
            Some(key) => Fault {
                field: match (path.as_str(), key.is_empty()) {
                    (_, true) => "body".to_owned(),
                    (".", false) => key,
                    _ => format!("{path}.{key}"),
                },
                problem: "comes twice in one object".to_owned(),
            },
            None => json_body::fault_of(path, &e),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_named_twice_at_any_depth_is_refused() {
        let refused = |body: &str| parse(body.as_bytes()).unwrap_err().field;
        assert_eq!(refused(r#"{"capacity": 5, "capacity": 500}"#), "capacity");
        assert_eq!(
            refused(r#"{"shares": {"eu": 0.5, "eu": 0.7}}"#),
            "shares.eu"
        );
        assert_eq!(
            refused(r#"{"limits": [{"quota": 1, "quota": 2}]}"#),
            "limits[0].quota"
        );
        assert_eq!(
            parse(br#"{"a": 1, "a": 2}"#).unwrap_err().to_string(),
            "a: comes twice in one object"
        );
    }

    #[test]
    fn anything_else_reads_as_serde_json_reads_it() {
        let body = r#"{"a": [1, -2, 2.5, "x", null, true], "b": {"c": 18446744073709551615}}"#;
        assert_eq!(
            parse(body.as_bytes()).unwrap(),
            serde_json::from_str::<Value>(body).unwrap()
        );
        assert!(parse(b"{\"a\": 1").is_err());
    }
}
