//! The label values of the metrics, each a closed set: every enum here
//! names its values once ([`BreakerState::as_str`] and the like), so no
//! label travels as free text.

/// Where a circuit breaker stands (the breaker's own state, named here
/// with its label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go to Redis.
    Closed = 0,
    /// Calls skip Redis; the local limiter decides.
    Open = 1,
    /// Calls still skip Redis while one probe checks whether it is back.
    HalfOpen = 2,
}

impl BreakerState {
    /// Every state, in label order.
    pub(super) const ALL: [Self; 3] = [Self::Closed, Self::Open, Self::HalfOpen];

    /// Lower-case name for JSON, logs and the `to` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }

    /// The state stored as `n` by its discriminant.
    pub fn from_u8(n: u8) -> Self {
        match n {
            1 => Self::Open,
            2 => Self::HalfOpen,
            _ => Self::Closed,
        }
    }
}

/// Why a request was answered before any route was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unrouted {
    /// No route matches: 404.
    NoRoute,
    /// A method that is never proxied, or an ambiguous path: 405 / 400.
    BadRequest,
}

impl Unrouted {
    /// Every reason, in label order.
    pub(super) const ALL: [Self; 2] = [Self::NoRoute, Self::BadRequest];

    /// The `outcome` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::NoRoute => "no_route",
            Self::BadRequest => "bad_request",
        }
    }
}

/// Which body a client moved too slowly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyDirection {
    /// The request body (upload).
    Request,
    /// The response body (download).
    Response,
}

impl BodyDirection {
    /// Both, in label order.
    pub(super) const ALL: [Self; 2] = [Self::Request, Self::Response];

    /// The `body` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Request => "request",
            Self::Response => "response",
        }
    }
}

/// What happened to tokens of a limit on what answers cost (the `kind` of
/// `tollgate_usage_tokens_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageKind {
    /// Taken up front by a request on a `usage_header` route.
    Reserved,
    /// Charged after the fact: usage beyond a reservation, or reported
    /// through `POST /v1/charge` or an RLS charge.
    Charged,
    /// Given back: a reservation not used up, or a negative charge.
    Refunded,
    /// A reservation never settled (its answer reported no usage, failed
    /// or was cut off): kept as the request's cost.
    Expired,
}

impl UsageKind {
    /// Every kind, in label order.
    pub(super) const ALL: [Self; 4] =
        [Self::Reserved, Self::Charged, Self::Refunded, Self::Expired];

    /// The `kind` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Reserved => "reserved",
            Self::Charged => "charged",
            Self::Refunded => "refunded",
            Self::Expired => "expired",
        }
    }
}

/// Where a decision came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionSource {
    /// The shared bucket in Redis.
    Redis,
    /// This instance's local limiter (local-only mode or fallback).
    Local,
    /// Tokens leased earlier from Redis, spent locally.
    Lease,
    /// The over-limit cache: Redis said no tokens before a retry time.
    Cache,
}

impl DecisionSource {
    /// Every source, in label order.
    pub(super) const ALL: [Self; 4] = [Self::Redis, Self::Local, Self::Lease, Self::Cache];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Redis => "redis",
            Self::Local => "local",
            Self::Lease => "lease",
            Self::Cache => "cache",
        }
    }
}

/// Why a Redis call, or one decision in it, got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisErrorKind {
    /// Redis did not answer within `redis.timeout_ms`.
    Timeout,
    /// No connection, or it broke.
    Connection,
    /// Redis answered with an error about itself (busy, out of memory,
    /// loading, no permission) or a reply of the wrong shape.
    Server,
    /// Redis answered, refusing one decision for what it carried (its
    /// key holds a value the script does not own, an argument it cannot
    /// use); Redis itself is well, and the breaker does not count it.
    Refused,
    /// The worker's queue of decisions for Redis was full.
    QueueFull,
}

impl RedisErrorKind {
    /// Every kind, in label order.
    pub(super) const ALL: [Self; 5] = [
        Self::Timeout,
        Self::Connection,
        Self::Server,
        Self::Refused,
        Self::QueueFull,
    ];

    /// The `kind` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Connection => "connection",
            Self::Server => "server",
            Self::Refused => "refused",
            Self::QueueFull => "queue_full",
        }
    }
}

/// How a round ended, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundResult {
    /// New shares were written.
    Applied,
    /// The shares already match the demand.
    Unchanged,
    /// Another instance leads.
    NotLeader,
    /// Prometheus could not be asked.
    PrometheusError,
    /// Prometheus had no demand to go by.
    NoData,
    /// PostgreSQL failed.
    DatabaseError,
    /// The round took longer than 30 s; the leader session was dropped
    /// (and with it the lock).
    Timeout,
}

impl RoundResult {
    /// Every result, in label order.
    pub(super) const ALL: [Self; 7] = [
        Self::Applied,
        Self::Unchanged,
        Self::NotLeader,
        Self::PrometheusError,
        Self::NoData,
        Self::DatabaseError,
        Self::Timeout,
    ];

    /// The `result` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Unchanged => "unchanged",
            Self::NotLeader => "not_leader",
            Self::PrometheusError => "prometheus_error",
            Self::Timeout => "timeout",
            Self::NoData => "no_data",
            Self::DatabaseError => "database_error",
        }
    }
}
