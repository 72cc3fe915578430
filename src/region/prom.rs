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

/// A Prometheus server's query API.
#[derive(Clone)]
pub struct Prometheus {
    /// Base URL, e.g. `http://127.0.0.1:9090`.
    base: String,
    /// HTTP client (single-threaded: lives on the rebalancer's arbiter).
    client: awc::Client,
}

impl Prometheus {
    /// A client for the server at `base`.
    pub fn new(base: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
            client: awc::Client::builder()
                .timeout(Duration::from_secs(10))
                .disable_redirects()
                .finish(),
        }
    }

    /// Demand over `window`, one entry per labelled series.
    ///
    /// # Errors
    /// [`PromError`] when Prometheus is unreachable or answers oddly.
    pub async fn demand(&self, window: Duration) -> Result<Vec<Demand>, PromError> {
        let url = format!("{}/api/v1/query", self.base);
        let mut response = self
            .client
            .get(url)
            .query(&[("query", demand_query(window))])
            .map_err(|e| PromError::Request(e.to_string()))?
            .send()
            .await
            .map_err(|e| PromError::Request(e.to_string()))?;
        let body = response
            .body()
            .limit(16 * 1024 * 1024)
            .await
            .map_err(|e| PromError::Request(e.to_string()))?;
        if !response.status().is_success() {
            return Err(PromError::Request(format!("status {}", response.status())));
        }
        parse(&body)
    }
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
