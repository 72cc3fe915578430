//! Validated identifiers and the Redis keys built from them.
//!
//! Owns [`TenantId`] and [`RouteId`], the only way a client-supplied or
//! configured identifier becomes part of a Redis key, and [`BucketKey`]
//! (`rl2:{<tenant>}:<route>`, or `rl2:<tenant>:<route>:<i>` for sub-bucket
//! i of a sharded rule). The prefix names the bucket state format
//! ([`BUCKET_PREFIX`]): a gateway of another format uses other keys, so two
//! formats never meet on one key.
//!
//! Invariants: an id is 1 to [`MAX_ID_LEN`] bytes drawn from the safe set
//! `A-Z a-z 0-9 . _ : -`. In particular `{` and `}` never pass, so the Redis
//! Cluster hash tag in `rl2:{<tenant>}:<route>` always spans exactly the
//! tenant.
//!
//! A tenant id is an API key, a secret: logs and metric labels show a
//! tenant as [`tenant_label`], its rule's [`TenantName`] or a short
//! [`fingerprint`] of the key, never the key itself.

use std::fmt;
use std::sync::Arc;

/// Longest accepted tenant or route id, in bytes.
pub const MAX_ID_LEN: usize = 64;

/// Why an id was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The id is the empty string.
    #[error("is empty")]
    Empty,
    /// The id is longer than [`MAX_ID_LEN`] bytes.
    #[error("is longer than {MAX_ID_LEN} bytes")]
    TooLong,
    /// The id holds a byte outside `A-Z a-z 0-9 . _ : -`.
    #[error("may only contain letters, digits and . _ : -")]
    BadChar,
    /// A route id holds `:`.
    #[error("may not contain ':' (route ids only)")]
    RouteColon,
    /// A name holds a byte outside `A-Z a-z 0-9 . _ : -` and space.
    #[error("may only contain letters, digits, spaces and . _ : -")]
    NameChar,
    /// A name starts with something other than a letter or digit.
    #[error("must start with a letter or digit")]
    NameStart,
}

/// Checks an id against the length limit and the safe character set.
///
/// # Errors
/// [`IdError`] when `raw` is empty, too long or holds an unsafe character.
pub fn validate_id(raw: &str) -> Result<(), IdError> {
    if raw.is_empty() {
        return Err(IdError::Empty);
    }
    if raw.len() > MAX_ID_LEN {
        return Err(IdError::TooLong);
    }
    let safe = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-');
    if raw.bytes().all(safe) {
        Ok(())
    } else {
        Err(IdError::BadChar)
    }
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $validate:path) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            /// Validates `raw` and wraps it.
            ///
            /// # Errors
            /// [`IdError`] when `raw` is empty, too long or holds an unsafe character.
            pub fn parse(raw: &str) -> Result<Self, IdError> {
                $validate(raw)?;
                Ok(Self(Arc::from(raw)))
            }

            /// The id as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }
    };
}

id_type!(
    /// A tenant, identified by the `X-Api-Key` header value.
    TenantId,
    validate_id
);
id_type!(
    /// A gateway route id from the route table. Unlike a tenant it may not
    /// contain `:`, so a sub-bucket key `rl2:<tenant>:<route>:<i>` always
    /// reads back as one (tenant, route) pair.
    RouteId,
    validate_route_id
);

/// `key` (a bucket key with the tenant's hash tag) in sub-group `shard` of
/// a sharded rule with several limits: the tag `{<tenant>}` becomes
/// `{<tenant>/<shard>}` (no tenant id holds `/`), so each sub-group's keys
/// share a slot of their own and the sub-groups spread over Redis Cluster
/// nodes.
pub fn in_sub_group(key: &str, shard: u32) -> String {
    let mut out = key.to_owned();
    if let Some(close) = out.find('}') {
        let mut tag = String::with_capacity(11);
        tag.push('/');
        tag.push_str(itoa::Buffer::new().format(shard));
        out.insert_str(close, &tag);
    }
    out
}

/// How a tenant-wide rule names its scope: every route of the tenant.
pub const ALL_ROUTES: &str = "*";

impl RouteId {
    /// The scope of a tenant-wide rule (`*`, which no route id can be):
    /// its limits count every route's requests.
    pub fn all() -> Self {
        /// Made once: every request under a tenant-wide rule names it.
        static ALL: std::sync::LazyLock<RouteId> =
            std::sync::LazyLock::new(|| RouteId(Arc::from(ALL_ROUTES)));
        ALL.clone()
    }

    /// A rule's scope as written: a route id, or `*` for [`RouteId::all`].
    ///
    /// # Errors
    /// [`IdError`] when `raw` is neither.
    pub fn parse_scope(raw: &str) -> Result<Self, IdError> {
        if raw == ALL_ROUTES {
            Ok(Self::all())
        } else {
            Self::parse(raw)
        }
    }

    /// Whether this is the tenant-wide scope, [`RouteId::all`].
    pub fn is_all(&self) -> bool {
        &*self.0 == ALL_ROUTES
    }
}

id_type!(
    /// A tenant's display name (from its rule), shown in logs and metric
    /// labels instead of its key.
    TenantName,
    validate_name
);

/// Checks a display name: 1 to [`MAX_ID_LEN`] bytes of letters, digits,
/// spaces and `. _ : -`, starting with a letter or digit (so it never reads
/// as a reserved label such as `_other`, nor as a [`fingerprint`]).
///
/// # Errors
/// [`IdError`] when `raw` is empty, too long, or holds or starts with a
/// byte outside those sets.
pub fn validate_name(raw: &str) -> Result<(), IdError> {
    if raw.is_empty() {
        return Err(IdError::Empty);
    }
    if raw.len() > MAX_ID_LEN {
        return Err(IdError::TooLong);
    }
    let ok = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b' ' | b'.' | b'_' | b':' | b'-');
    if !raw.bytes().all(ok) {
        return Err(IdError::NameChar);
    }
    if !raw.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(IdError::NameStart);
    }
    Ok(())
}

/// A short, stable fingerprint of a tenant's key for logs and labels: `#`
/// and 8 hex digits of its 64-bit FNV-1a hash. The same on every gateway
/// and every version; it does not hide a key that can be guessed (give
/// such tenants a name).
pub fn fingerprint(tenant: &str) -> String {
    format!("#{:08x}", fnv1a(tenant) >> 32)
}

/// [`fingerprint`] with all 16 hex digits, to tell apart tenants whose
/// labels would otherwise be equal.
pub fn full_fingerprint(tenant: &str) -> String {
    format!("#{:016x}", fnv1a(tenant))
}

/// The 64-bit FNV-1a hash of `text` (fixed by its definition, so stable
/// across gateways and releases).
fn fnv1a(text: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0100_0000_01b3;
    text.bytes()
        .fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}

/// How a tenant appears in logs and labels: its `name` when it has one,
/// else its [`fingerprint`].
pub fn tenant_label(tenant: &str, name: Option<&TenantName>) -> String {
    name.map_or_else(|| fingerprint(tenant), ToString::to_string)
}

/// [`validate_id`], and no `:`.
///
/// # Errors
/// [`IdError`] when `raw` is not a valid id or contains `:`.
pub fn validate_route_id(raw: &str) -> Result<(), IdError> {
    validate_id(raw)?;
    if raw.contains(':') {
        Err(IdError::RouteColon)
    } else {
        Ok(())
    }
}

/// Room for `tenant/route` with both ids at their longest.
pub const PAIR_KEY_BUF: usize = 2 * MAX_ID_LEN + 1;

/// Separator of [`pair_key`]; not in the id charset.
pub const PAIR_SEP: char = '/';

/// Writes the in-memory lookup key `tenant/route` (either side may be
/// empty) into `buf`, without allocating; `None` when either side is longer
/// than [`MAX_ID_LEN`] (nothing is stored under such a key).
pub fn pair_key<'a>(buf: &'a mut [u8; PAIR_KEY_BUF], tenant: &str, route: &str) -> Option<&'a str> {
    let (t, r) = (tenant.as_bytes(), route.as_bytes());
    if t.len() > MAX_ID_LEN || r.len() > MAX_ID_LEN {
        return None;
    }
    buf[..t.len()].copy_from_slice(t);
    buf[t.len()] = PAIR_SEP as u8;
    buf[t.len() + 1..t.len() + 1 + r.len()].copy_from_slice(r);
    std::str::from_utf8(&buf[..t.len() + 1 + r.len()]).ok()
}

/// Prefix of every bucket key, naming the state format of
/// `lua/token_bucket.lua`: `rl2:` holds one number (the theoretical arrival
/// time); the hashes of format 1 lived under `rl:`.
pub const BUCKET_PREFIX: &str = "rl2:";

/// The Redis key of one (tenant, route) bucket: `rl2:{<tenant>}:<route>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BucketKey(String);

impl BucketKey {
    /// The key of the bucket for `tenant` on `route`.
    pub fn new(tenant: &TenantId, route: &RouteId) -> Self {
        let (t, r) = (tenant.as_str(), route.as_str());
        let mut key = String::with_capacity(BUCKET_PREFIX.len() + 3 + t.len() + r.len());
        key.push_str(BUCKET_PREFIX);
        key.push('{');
        key.push_str(t);
        key.push_str("}:");
        key.push_str(r);
        Self(key)
    }

    /// The key of sub-bucket `index` of a sharded bucket:
    /// `rl2:<tenant>:<route>:<index>`, without a hash tag so that the
    /// sub-buckets spread over Redis Cluster nodes.
    pub fn shard(tenant: &TenantId, route: &RouteId, index: u32) -> Self {
        let (t, r) = (tenant.as_str(), route.as_str());
        let mut digits = itoa::Buffer::new();
        let i = digits.format(index);
        let mut key = String::with_capacity(BUCKET_PREFIX.len() + 2 + t.len() + r.len() + i.len());
        key.push_str(BUCKET_PREFIX);
        key.push_str(t);
        key.push(':');
        key.push_str(r);
        key.push(':');
        key.push_str(i);
        Self(key)
    }

    /// The key of a rule's further limit `index` (1 and up; 0 is the
    /// rule's first bucket, [`BucketKey::new`]): `rl2:{<tenant>}:<route>#<index>`,
    /// followed by `tag` (a quota's window, so that a changed window starts
    /// a fresh count). It shares the tenant's hash tag, so one call holds
    /// every limit of a request.
    pub fn further(tenant: &TenantId, route: &RouteId, index: usize, tag: &str) -> Self {
        let mut key = Self::new(tenant, route).0;
        key.push('#');
        key.push_str(itoa::Buffer::new().format(index));
        key.push_str(tag);
        Self(key)
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tenant(id: &str) -> TenantId {
        TenantId::parse(id).unwrap()
    }

    fn route(id: &str) -> RouteId {
        RouteId::parse(id).unwrap()
    }

    #[test]
    fn accepts_the_documented_charset() {
        assert!(TenantId::parse("shop-a_1.eu:prod").is_ok());
        assert!(TenantId::parse(&"a".repeat(MAX_ID_LEN)).is_ok());
    }

    #[test]
    fn rejects_empty_long_and_unsafe_ids() {
        assert_eq!(TenantId::parse(""), Err(IdError::Empty));
        assert_eq!(
            TenantId::parse(&"a".repeat(MAX_ID_LEN + 1)),
            Err(IdError::TooLong)
        );
        for bad in ["a{b", "a}b", "a b", "a/b", "é", "a\nb", "a*"] {
            assert_eq!(TenantId::parse(bad), Err(IdError::BadChar), "{bad:?}");
        }
    }

    #[test]
    fn names_are_readable_and_never_look_reserved() {
        assert!(TenantName::parse("Acme Corp. EU-1").is_ok());
        assert_eq!(TenantName::parse("_other"), Err(IdError::NameStart));
        assert_eq!(TenantName::parse(" x"), Err(IdError::NameStart));
        assert_eq!(TenantName::parse("#1234"), Err(IdError::NameChar));
        assert_eq!(TenantName::parse("a\"b"), Err(IdError::NameChar));
        assert_eq!(TenantName::parse(""), Err(IdError::Empty));
    }

    #[test]
    fn labels_show_the_name_or_a_stable_fingerprint_never_the_key() {
        let name = TenantName::parse("Acme").unwrap();
        assert_eq!(tenant_label("sk-live-123", Some(&name)), "Acme");
        let fp = tenant_label("sk-live-123", None);
        assert_eq!(fp, fingerprint("sk-live-123"));
        assert!(fp.starts_with('#') && fp.len() == 9, "{fp}");
        assert!(!fp.contains("sk-live"));
        assert_ne!(fp, fingerprint("sk-live-124"));
        // Fixed by the algorithm: the same on every gateway and release.
        assert_eq!(fingerprint(""), "#cbf29ce4");
    }

    #[test]
    fn bucket_key_uses_the_tenant_as_hash_tag() {
        let key = BucketKey::new(&tenant("shop-a"), &route("create-order"));
        assert_eq!(key.as_str(), "rl2:{shop-a}:create-order");
    }

    #[test]
    fn route_ids_may_not_contain_colons() {
        assert_eq!(RouteId::parse("a:b"), Err(IdError::RouteColon));
        let key = BucketKey::further(&tenant("acme"), &route("search"), 1, "d");
        assert_eq!(in_sub_group(key.as_str(), 3), "rl2:{acme/3}:search#1d");
        assert!(TenantId::parse("a:b").is_ok());
    }

    #[test]
    fn shard_keys_have_no_hash_tag() {
        let key = BucketKey::shard(&tenant("big"), &route("search"), 3);
        assert_eq!(key.as_str(), "rl2:big:search:3");
    }

    proptest! {
        #[test]
        fn valid_ids_never_break_the_hash_tag(raw in "\\PC{0,80}") {
            if let Ok(t) = TenantId::parse(&raw) {
                let key = BucketKey::new(&t, &route("r"));
                let s = key.as_str();
                prop_assert_eq!(s.matches('{').count(), 1);
                prop_assert_eq!(s.matches('}').count(), 1);
                prop_assert!(t.as_str().len() <= MAX_ID_LEN);
            }
        }
    }
}
