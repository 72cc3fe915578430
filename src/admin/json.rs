//! Admin request bodies as JSON that says one thing.
//!
//! Owns how an admin body becomes a [`Value`]: like `serde_json`, except
//! that an object naming a key twice, at any depth, is refused instead of
//! keeping the last copy, as `POST /v1/check` refuses it. Two copies of
//! `capacity` would otherwise let whatever wrote the body, or a proxy that
//! rewrote part of it, decide which limit is stored.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// A [`Value`] whose objects name each key once.
struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor)
    }
}

/// Builds a [`Strict`] value, refusing repeated keys.
struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Strict, E> {
        Ok(Strict(Value::Bool(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Strict, E> {
        Ok(Strict(Value::from(v)))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Strict, E> {
        Ok(Strict(Value::from(v)))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Strict, E> {
        Ok(Strict(Value::from(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Strict, E> {
        Ok(Strict(Value::String(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Strict, E> {
        Ok(Strict(Value::String(v)))
    }

    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
        let mut list = Vec::new();
        while let Some(Strict(item)) = seq.next_element()? {
            list.push(item);
        }
        Ok(Strict(Value::Array(list)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(format_args!(
                    "the key \"{}\" comes twice",
                    key.escape_debug()
                )));
            }
            let Strict(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(Strict(Value::Object(object)))
    }
}

/// Parses `body` as JSON whose objects name every key once.
///
/// # Errors
/// `serde_json`'s error for malformed JSON, or one naming the repeated key.
pub(super) fn parse(body: &[u8]) -> Result<Value, serde_json::Error> {
    serde_json::from_slice::<Strict>(body).map(|Strict(value)| value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_named_twice_at_any_depth_is_refused() {
        let refused = |body: &str| parse(body.as_bytes()).unwrap_err().to_string();
        assert!(
            refused(r#"{"capacity": 5, "capacity": 500}"#).contains("\"capacity\" comes twice")
        );
        assert!(refused(r#"{"shares": {"eu": 0.5, "eu": 0.7}}"#).contains("\"eu\" comes twice"));
        assert!(refused(r#"{"limits": [{"quota": 1, "quota": 2}]}"#).contains("\"quota\""));
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
