//! Per-region demand from the Prometheus HTTP API.
//!
//! Owns the one query the rebalancer asks: the rate of requests that
//! reached the limiter (allowed + rejected), by region, tenant and route,
//! over the configured window. The `region` label is the one Prometheus
//! attaches to each scraped gateway (see `config/prometheus.yml`).

use std::time::Duration;

use serde::Deserialize;

/// One (region, tenant, route) demand, in requests per second.
#[derive(Debug, Clone, PartialEq)]
pub struct Demand {
    /// Region label.
    pub region: String,
    /// Tenant label (`_other` for tenants without a label of their own).
    pub tenant: String,
    /// Route label.
    pub route: String,
    /// Requests per second.
    pub rate: f64,
}

/// Why demand could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PromError {
    /// Prometheus could not be reached or answered with an error status.
    #[error("prometheus request failed: {0}")]
    Request(String),
    /// The answer was not a successful vector result.
    #[error("unexpected prometheus answer: {0}")]
    Answer(String),
}

/// The PromQL of the demand query over `window`. Only series that already
/// existed a whole window ago count (`and … offset`): the rate of a younger
/// series (a gateway or a labelled tenant that just appeared) would be
/// judged on part of the window and underestimated; its region then shows
/// as unseen and the round holds the shares still.
pub fn demand_query(window: Duration) -> String {
    let seconds = window.as_secs().max(1);
    format!(
        "sum by (region, tenant, route) (\
         rate(tollgate_requests_total{{outcome=~\"allowed|rejected|shadow_rejected\"}}[{seconds}s]) \
         and tollgate_requests_total{{outcome=~\"allowed|rejected|shadow_rejected\"}} offset {seconds}s)"
    )
}

/// A Prometheus server's query API, reached over plain HTTP/1.1 with one
/// connection per query (a query every few minutes needs no pool).
#[derive(Clone)]
pub struct Prometheus {
    /// `host:port` of the server.
    authority: String,
    /// Path prefix before `/api/v1/query` (`""` or `/prefix`).
    prefix: String,
}

/// Longest wait for one query, connection included.
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest answer read.
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

impl Prometheus {
    /// A client for the server at `base` (`http://host:port[/prefix]`, as
    /// the configuration check admits it).
    pub fn new(base: &str) -> Self {
        let rest = base.strip_prefix("http://").unwrap_or(base);
        let (authority, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_end_matches('/');
        Self {
            authority: authority.to_owned(),
            prefix: if prefix.is_empty() {
                String::new()
            } else {
                format!("/{prefix}")
            },
        }
    }

    /// Demand over `window`, one entry per labelled series.
    ///
    /// # Errors
    /// [`PromError`] when Prometheus is unreachable or answers oddly.
    pub async fn demand(&self, window: Duration) -> Result<Vec<Demand>, PromError> {
        let path = format!(
            "{}/api/v1/query?query={}",
            self.prefix,
            encode_query_value(&demand_query(window))
        );
        let body = tokio::time::timeout(QUERY_TIMEOUT, self.get(&path))
            .await
            .map_err(|_| PromError::Request(format!("no answer within {QUERY_TIMEOUT:?}")))??;
        parse(&body)
    }

    /// `GET path` on a new connection; the body of a 2xx answer. The
    /// connection is driven here, beside the request, so it closes with
    /// the query, also when the caller's timeout drops it half-way.
    async fn get(&self, path: &str) -> Result<Vec<u8>, PromError> {
        let stream = tokio::net::TcpStream::connect(&self.authority)
            .await
            .map_err(|e| failed(&e))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| failed(&e))?;
        let request = hyper::Request::get(path)
            .header(hyper::header::HOST, &self.authority)
            .body(String::new())
            .map_err(|e| failed(&e))?;
        let answer = async move {
            let response = sender.send_request(request).await.map_err(|e| failed(&e))?;
            if !response.status().is_success() {
                return Err(PromError::Request(format!("status {}", response.status())));
            }
            read_body(response.into_body()).await
        };
        tokio::pin!(answer);
        tokio::select! {
            biased;
            read = &mut answer => read,
            // A connection that ends cleanly (the server closing after its
            // answer) may leave the answer to finish reading what came.
            closed = connection => match closed {
                Ok(()) => answer.await,
                Err(e) => Err(failed(&e)),
            },
        }
    }
}

/// A request failure, with its cause.
fn failed(e: &dyn std::fmt::Display) -> PromError {
    PromError::Request(e.to_string())
}

/// Reads `body` to its end, refusing more than [`MAX_ANSWER_BYTES`].
async fn read_body(mut body: hyper::body::Incoming) -> Result<Vec<u8>, PromError> {
    use hyper::body::Body as _;

    let mut bytes = Vec::new();
    while let Some(frame) =
        std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await
    {
        if let Ok(data) = frame.map_err(|e| failed(&e))?.into_data() {
            bytes.extend_from_slice(&data);
            if bytes.len() > MAX_ANSWER_BYTES {
                return Err(PromError::Request(format!(
                    "answer larger than {MAX_ANSWER_BYTES} bytes"
                )));
            }
        }
    }
    Ok(bytes)
}

/// `value` percent-encoded for a query string: every byte but the
/// unreserved ones (`A-Z a-z 0-9 - . _ ~`) becomes `%XX`.
fn encode_query_value(value: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(value.len() * 3);
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

/// The query API's answer.
#[derive(Deserialize)]
struct Answer {
    status: String,
    data: Option<Data>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Data {
    result_type: String,
    result: Vec<Sample>,
}

#[derive(Deserialize)]
struct Sample {
    metric: std::collections::HashMap<String, String>,
    value: (f64, String),
}

/// Parses a vector answer; series without region, tenant or route labels,
/// or with a non-finite value, are skipped.
fn parse(body: &[u8]) -> Result<Vec<Demand>, PromError> {
    let answer: Answer =
        serde_json::from_slice(body).map_err(|e| PromError::Answer(e.to_string()))?;
    let data = match (answer.status.as_str(), answer.data) {
        ("success", Some(d)) if d.result_type == "vector" => d,
        (status, _) => return Err(PromError::Answer(format!("status {status:?}"))),
    };
    Ok(data
        .result
        .into_iter()
        .filter_map(|s| {
            let rate: f64 = s.value.1.parse().ok().filter(|r: &f64| r.is_finite())?;
            Some(Demand {
                region: s.metric.get("region")?.clone(),
                tenant: s.metric.get("tenant")?.clone(),
                route: s.metric.get("route")?.clone(),
                rate,
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_encoded_and_base_urls_split() {
        assert_eq!(
            encode_query_value("sum by (a) (rate(x{o=~\"a|b\"}[60s]))"),
            "sum%20by%20%28a%29%20%28rate%28x%7Bo%3D~%22a%7Cb%22%7D%5B60s%5D%29%29"
        );
        let p = Prometheus::new("http://127.0.0.1:9090");
        assert_eq!(
            (p.authority.as_str(), p.prefix.as_str()),
            ("127.0.0.1:9090", "")
        );
        let p = Prometheus::new("http://prom:9090/monitoring/");
        assert_eq!(
            (p.authority.as_str(), p.prefix.as_str()),
            ("prom:9090", "/monitoring")
        );
    }

    #[tokio::test]
    async fn a_query_given_up_on_closes_its_connection() {
        use std::io::Read as _;

        // A server that accepts and never answers: a paused Prometheus.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let prom = Prometheus::new(&format!("http://{}", listener.local_addr().unwrap()));
        let query = tokio::time::timeout(Duration::from_millis(200), prom.get("/api/v1/query"));
        assert!(query.await.is_err(), "the silent server answered");
        let (mut accepted, _) = listener.accept().unwrap();
        accepted
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        // The request arrives, then the end of the stream: nothing was
        // left running to hold the connection open.
        let mut seen = Vec::new();
        accepted.read_to_end(&mut seen).unwrap();
        assert!(seen.starts_with(b"GET /api/v1/query HTTP/1.1"), "{seen:?}");
    }

    #[test]
    fn vector_answers_become_demand() {
        let body = br#"{"status":"success","data":{"resultType":"vector","result":[
            {"metric":{"region":"eu-west","tenant":"shop-a","route":"orders"},"value":[1.5,"70.5"]},
            {"metric":{"tenant":"no-region","route":"orders"},"value":[1.5,"3"]},
            {"metric":{"region":"us-east","tenant":"_other","route":"orders"},"value":[1.5,"NaN"]}
        ]}}"#;
        let demand = parse(body).unwrap();
        assert_eq!(demand.len(), 1);
        assert_eq!(
            (demand[0].region.as_str(), demand[0].rate),
            ("eu-west", 70.5)
        );
    }

    #[test]
    fn errors_and_other_result_types_are_refused() {
        assert!(parse(br#"{"status":"error","errorType":"bad_data","error":"x"}"#).is_err());
        assert!(
            parse(br#"{"status":"success","data":{"resultType":"matrix","result":[]}}"#).is_err()
        );
        assert!(parse(b"<html>").is_err());
    }

    #[test]
    fn the_query_counts_what_reached_the_limiter_over_whole_windows_only() {
        assert_eq!(
            demand_query(Duration::from_secs(300)),
            "sum by (region, tenant, route) (\
             rate(tollgate_requests_total{outcome=~\"allowed|rejected|shadow_rejected\"}[300s]) \
             and tollgate_requests_total{outcome=~\"allowed|rejected|shadow_rejected\"} offset 300s)"
        );
    }
}
