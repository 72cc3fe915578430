//! Finding the primaries: a Cluster's slot owners, or the primary
//! Sentinel names.
//!
//! Owns the questions asked of the deployment itself, each bounded by the
//! connection timeout: `CLUSTER SLOTS` of any reachable node
//! ([`cluster_owners`]), and Sentinel's lookup of the monitored primary,
//! which also checks that the server named answers `ROLE` as a primary
//! ([`SentinelLookup`]), so a demoted primary is never written to.
//! Nothing here publishes; [`super::watch`] does.

use std::collections::BTreeMap;
use std::time::Duration;

use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{ConnectionAddr, RedisResult, TlsMode, Value};

use super::node::{Endpoints, NodeAddr};
use super::topology::Owner;

/// Why no primary was found.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DiscoveryError {
    /// No node or sentinel answered within the timeout.
    #[error("no Redis node answered in time")]
    Timeout,
    /// A node or sentinel answered with an error, or could not be reached.
    #[error("{0}")]
    Redis(#[from] redis::RedisError),
    /// `CLUSTER SLOTS` answered something else than slot ranges.
    #[error("unexpected CLUSTER SLOTS reply")]
    BadReply,
}

/// Asks each of `candidates` in turn for the Cluster's slot owners; the
/// first answer wins.
///
/// # Errors
/// The last failure, when none answered.
pub(crate) async fn cluster_owners(
    endpoints: &Endpoints,
    candidates: &[NodeAddr],
    timeout: Duration,
) -> Result<Vec<Owner>, DiscoveryError> {
    let mut last = DiscoveryError::Timeout;
    for addr in candidates {
        let ask = async {
            let client = endpoints.data_client(addr, 0)?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async::<Value>(&mut conn)
                .await
        };
        match tokio::time::timeout(timeout, ask).await {
            Ok(Ok(reply)) => match owners_of(&reply, addr) {
                Some(owners) if !owners.is_empty() => return Ok(owners),
                _ => last = DiscoveryError::BadReply,
            },
            Ok(Err(e)) => last = e.into(),
            Err(_) => last = DiscoveryError::Timeout,
        }
    }
    Err(last)
}

/// The primaries of a `CLUSTER SLOTS` reply from `asked`, sorted by
/// address.
fn owners_of(reply: &Value, asked: &NodeAddr) -> Option<Vec<Owner>> {
    let Value::Array(ranges) = reply else {
        return None;
    };
    let mut by_addr: BTreeMap<NodeAddr, Vec<(u16, u16)>> = BTreeMap::new();
    for range in ranges {
        let Value::Array(fields) = range else {
            return None;
        };
        let (start, end, primary) = match fields.as_slice() {
            [
                Value::Int(start),
                Value::Int(end),
                Value::Array(primary),
                ..,
            ] => (
                u16::try_from(*start).ok()?,
                u16::try_from(*end).ok()?,
                primary,
            ),
            _ => return None,
        };
        // An empty or null host is the node asked; `?` is an endpoint
        // the node does not know, which no client can reach: its slots
        // stay unserved until a later lookup names it.
        let host = match primary.first()? {
            Value::BulkString(b) => String::from_utf8(b.clone()).ok()?,
            Value::SimpleString(s) => s.clone(),
            Value::Nil => String::new(),
            _ => return None,
        };
        if host == "?" {
            continue;
        }
        let port = match primary.get(1)? {
            Value::Int(p) => u16::try_from(*p).ok()?,
            _ => return None,
        };
        let host = if host.is_empty() { &*asked.host } else { &host };
        by_addr
            .entry(NodeAddr::new(host, port))
            .or_default()
            .push((start, end));
    }
    Some(
        by_addr
            .into_iter()
            .map(|(addr, ranges)| Owner { addr, ranges })
            .collect(),
    )
}

/// Sentinel's answer to "who is the primary of `master`", checked with
/// the primary itself.
pub(crate) struct SentinelLookup {
    /// The crate's Sentinel clients, one per sentinel to ask first (each
    /// asks the sentinels in its order, takes their answers in that order
    /// and checks the primary's role): a sentinel that hangs holds up
    /// only the lookups that ask it first.
    clients: Vec<SentinelClient>,
    /// The client the next lookup uses; moves on after a failure.
    next: usize,
}

impl SentinelLookup {
    /// A lookup of `master` through `sentinels`, speaking to sentinels and
    /// primary as `endpoints` say.
    ///
    /// # Errors
    /// When a client cannot be built (checked at configuration).
    pub(crate) fn new(
        endpoints: &Endpoints,
        sentinels: &[NodeAddr],
        master: &str,
    ) -> RedisResult<Self> {
        let clients = (0..sentinels.len())
            .map(|first| {
                let mut order = sentinels.to_vec();
                order.rotate_left(first);
                sentinel_client(endpoints, &order, master)
            })
            .collect::<RedisResult<_>>()?;
        Ok(Self { clients, next: 0 })
    }

    /// The primary now, bounded by `timeout`.
    ///
    /// # Errors
    /// When no sentinel names a primary that answers as one.
    pub(crate) async fn primary(&mut self, timeout: Duration) -> Result<NodeAddr, DiscoveryError> {
        let client = &mut self.clients[self.next];
        let found = match tokio::time::timeout(timeout, client.async_get_client()).await {
            Ok(Ok(client)) => {
                super::node::address(client.get_connection_info()).ok_or(DiscoveryError::BadReply)
            }
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(DiscoveryError::Timeout),
        };
        if found.is_err() {
            self.next = (self.next + 1) % self.clients.len();
        }
        found
    }
}

/// The crate's Sentinel client of `master` through `sentinels` (asked in
/// this order), speaking to sentinels and primary as `endpoints` say.
fn sentinel_client(
    endpoints: &Endpoints,
    sentinels: &[NodeAddr],
    master: &str,
) -> RedisResult<SentinelClient> {
    let (tls, data) = endpoints.data_settings();
    let addrs = sentinels.iter().map(|addr| {
        let host = addr.host.to_string();
        if tls {
            ConnectionAddr::TcpTls {
                host,
                port: addr.port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(host, addr.port)
        }
    });
    let sentinel = endpoints.sentinel_client(&sentinels[0])?;
    let sentinel_redis = sentinel.get_connection_info().redis_settings();
    let mut builder = SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)?;
    if let Some(user) = data.username() {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(password) = data.password() {
        builder = builder.set_client_to_redis_password(password);
    }
    if let Some(user) = sentinel_redis.username() {
        builder = builder.set_client_to_sentinel_username(user);
    }
    if let Some(password) = sentinel_redis.password() {
        builder = builder.set_client_to_sentinel_password(password);
    }
    if tls {
        builder = builder
            .set_client_to_redis_tls_mode(TlsMode::Secure)
            .set_client_to_sentinel_tls_mode(TlsMode::Secure);
        if let Some(certs) = endpoints.certificates() {
            builder = builder
                .set_client_to_redis_certificates(certs.clone())
                .set_client_to_sentinel_certificates(certs.clone());
        }
    }
    builder.build()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::BulkString(host.as_bytes().to_vec()),
            Value::Int(port),
            Value::BulkString(b"id".to_vec()),
        ])
    }

    #[test]
    fn cluster_slots_give_each_primary_its_ranges() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(99),
                node("10.0.0.1", 7001),
                node("10.0.0.4", 7004),
            ]),
            Value::Array(vec![Value::Int(100), Value::Int(199), node("", 7002)]),
            Value::Array(vec![Value::Int(301), Value::Int(400), node("?", 7009)]),
            Value::Array(vec![
                Value::Int(401),
                Value::Int(16383),
                Value::Array(vec![Value::Nil, Value::Int(7002)]),
            ]),
            Value::Array(vec![
                Value::Int(200),
                Value::Int(300),
                node("10.0.0.1", 7001),
            ]),
        ]);
        let owners = owners_of(&reply, &NodeAddr::new("seed", 7000)).unwrap();
        assert_eq!(
            owners,
            vec![
                Owner {
                    addr: NodeAddr::new("10.0.0.1", 7001),
                    ranges: vec![(0, 99), (200, 300)]
                },
                Owner {
                    addr: NodeAddr::new("seed", 7002),
                    ranges: vec![(100, 199), (401, 16383)]
                },
            ]
        );
        assert_eq!(owners_of(&Value::Int(1), &NodeAddr::new("s", 1)), None);
    }
}
