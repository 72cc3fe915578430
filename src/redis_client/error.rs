//! Why a Redis call produced no answer, and what each failure says: its
//! metric kind, whether Redis itself failed (the breaker counts it) or
//! refused what one call carried, and whether the layout may have
//! changed.

use redis::{ErrorKind, ServerErrorKind};

use crate::telemetry::RedisErrorKind;

/// Why a Redis call produced no answer.
#[derive(Debug, thiserror::Error)]
pub enum RedisCallError {
    /// Redis did not answer within the timeout; the call was abandoned.
    #[error("redis call timed out")]
    Timeout,
    /// No connection exists yet: the key's primary is not known.
    #[error("not connected to redis")]
    NotConnected,
    /// Redis answered with an error or the connection failed.
    #[error("redis call failed: {0}")]
    Redis(#[source] redis::RedisError),
    /// Redis answered, but not with what the script returns.
    #[error("unexpected reply from redis")]
    BadReply,
    /// The script could not decide this one decision (its key holds a
    /// value the script does not own, or an argument was unusable); the
    /// other decisions of its call were answered.
    #[error("redis refused this decision")]
    Refused,
    /// A coalesced decision got no answer (the reason kept for the logs):
    /// the call it rode, with others, failed (counted once, for the call),
    /// or it waited out the timeout, or its worker's queue was full.
    #[error("no answer from the shared redis call ({})", .0.label())]
    CallFailed(RedisErrorKind),
}

impl RedisCallError {
    /// What kind of failure this is, for metrics.
    pub fn kind(&self) -> RedisErrorKind {
        match self {
            Self::Timeout => RedisErrorKind::Timeout,
            Self::NotConnected => RedisErrorKind::Connection,
            Self::Redis(e) if e.is_io_error() || e.is_connection_dropped() => {
                RedisErrorKind::Connection
            }
            _ if self.is_refusal() => RedisErrorKind::Refused,
            Self::Redis(_) | Self::BadReply => RedisErrorKind::Server,
            Self::Refused => RedisErrorKind::Refused,
            Self::CallFailed(kind) => *kind,
        }
    }

    /// Whether Redis answered, refusing the call for what it carried
    /// rather than failing itself: a script error (`ERR`, `WRONGTYPE`, or
    /// the script's own `tollgate:` error) says nothing about the server's
    /// health, so the breaker does not count it, and the decisions that
    /// shared the call are asked again on their own.
    pub fn is_refusal(&self) -> bool {
        match self {
            Self::Refused => true,
            Self::Redis(e) => match e.kind() {
                ErrorKind::Server(ServerErrorKind::ResponseError | ServerErrorKind::CrossSlot) => {
                    true
                }
                ErrorKind::Extension => e
                    .code()
                    .is_some_and(|code| code == "WRONGTYPE" || code.starts_with("tollgate")),
                _ => false,
            },
            _ => false,
        }
    }

    /// Whether the server was reached and said its keys are elsewhere (or
    /// about to move): a routing miss, not a failing server.
    pub(super) fn is_redirection(&self) -> bool {
        matches!(self, Self::Redis(e) if matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::Moved
                    | ServerErrorKind::Ask
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ReadOnly
            )
        ))
    }

    /// Whether the failure may mean the layout changed.
    pub(super) fn suggests_new_layout(&self) -> bool {
        match self {
            Self::NotConnected | Self::Timeout => true,
            Self::Redis(e) => {
                e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || self.is_redirection()
                    || matches!(
                        e.kind(),
                        ErrorKind::Server(
                            ServerErrorKind::ClusterDown
                                | ServerErrorKind::MasterDown
                                | ServerErrorKind::BusyLoading
                        )
                    )
            }
            Self::BadReply | Self::Refused | Self::CallFailed(_) => false,
        }
    }
}
