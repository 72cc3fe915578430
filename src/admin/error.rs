//! Admin API failures and their HTTP responses.
//!
//! Every admin error answers with a small JSON body: a stable `error` code,
//! a human `message`, and for validation failures the `field` at fault.
//! Database error text is logged, never returned.

use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderValue, WWW_AUTHENTICATE};
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

use crate::db::DbError;

/// Why an admin request was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// No or wrong bearer token.
    #[error("missing or wrong bearer token")]
    Unauthorized,
    /// `admin.token` is empty, so writes are disabled.
    #[error("admin writes are disabled")]
    WritesDisabled,
    /// Neither `admin.token` nor `admin.read_token` is set, so reads are
    /// disabled.
    #[error("admin reads are disabled")]
    ReadsDisabled,
    /// Rules come from a file; the API cannot change them.
    #[error("rules come from a file")]
    FileMode,
    /// Shares need regions (`instance.region`) and a database.
    #[error("region shares are not stored here")]
    NoShareStore,
    /// A field of the request is invalid.
    #[error("invalid {field}: {message}")]
    Invalid {
        /// The offending field (`tenant`, `route`, `capacity`, …).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The request body is longer than the admin API accepts.
    #[error("request body too large")]
    TooLarge,
    /// No such rule.
    #[error("no rule for this tenant and route")]
    NotFound,
    /// The database failed or is unreachable.
    #[error("database unavailable: {0}")]
    Database(#[from] DbError),
}

impl AdminError {
    /// An [`AdminError::Invalid`] for `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }

    fn code(&self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::WritesDisabled => "writes_disabled",
            Self::ReadsDisabled => "reads_disabled",
            Self::FileMode => "rules_from_file",
            Self::NoShareStore => "shares_unavailable",
            Self::Invalid { .. } => "invalid_request",
            Self::TooLarge => "body_too_large",
            Self::NotFound => "not_found",
            Self::Database(_) => "database_unavailable",
        }
    }
}

impl ResponseError for AdminError {
    fn status_code(&self) -> StatusCode {
        match self {
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::WritesDisabled | Self::ReadsDisabled => StatusCode::FORBIDDEN,
            Self::FileMode | Self::NoShareStore => StatusCode::CONFLICT,
            Self::Invalid { .. } => StatusCode::BAD_REQUEST,
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::Database(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let message = match self {
            Self::Unauthorized => "Send Authorization: Bearer <admin.token>.".to_owned(),
            Self::WritesDisabled => "Admin writes are disabled: admin.token is empty. Set it \
                                     (or TOLLGATE__ADMIN__TOKEN) and send Authorization: Bearer <token>."
                .to_owned(),
            Self::ReadsDisabled => "Admin reads are disabled: admin.token and admin.read_token \
                                    are empty. Set one (or TOLLGATE__ADMIN__READ_TOKEN) and send \
                                    Authorization: Bearer <token>."
                .to_owned(),
            Self::FileMode => {
                "Rules come from a file (rules.file); edit the file instead, it is reloaded on change."
                    .to_owned()
            }
            Self::NoShareStore => "Region shares need instance.region and rules.database_url.".to_owned(),
            Self::Invalid { message, .. } => message.clone(),
            Self::TooLarge => "The request body is larger than 64 KiB.".to_owned(),
            Self::NotFound => "No rule exists for this tenant and route.".to_owned(),
            Self::Database(e) => {
                tracing::warn!(error = %e, "Admin request failed on the database.");
                "PostgreSQL did not answer; nothing was changed. Retry later.".to_owned()
            }
        };
        let mut body = json!({ "error": self.code(), "message": message });
        match self {
            Self::Invalid { field, .. } => body["field"] = json!(field),
            Self::TooLarge => body["field"] = json!("body"),
            _ => {}
        }
        let mut response = HttpResponse::build(self.status_code());
        if matches!(self, Self::Unauthorized) {
            response.insert_header((WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")));
        }
        response.json(body)
    }
}
