//! Load client for tollgate's three entry points, driven by
//! `scripts/bench-entries`: closed-loop clients, each on its own
//! connection, each sending its next request when the last is answered.
//!
//! ```text
//! cargo bench --bench entry_load -- <rls|check|proxy> ADDR CLIENTS SECONDS TENANTS [STREAMS]
//! ```
//!
//! - `rls`: `ShouldRateLimit` with one descriptor (`api_key`, `route`
//!   = `bench`), a gRPC client generated from Envoy's protos; every
//!   STREAMS clients (default 1) share one HTTP/2 connection, each client
//!   a stream of its own at a time, as Envoy multiplexes its calls over
//!   one connection per worker;
//! - `check`: `GET /v1/auth` with `X-Api-Key` and `X-Tollgate-Route:
//!   bench`, HTTP/1.1 keep-alive;
//! - `proxy`: `GET /` with `X-Api-Key` through the proxy, HTTP/1.1
//!   keep-alive.
//!
//! Request `i` of a client carries the key `t<(client + i * clients) %
//! TENANTS>`, so with TENANTS = 1 every request is the one hot key and with
//! many every request is a different tenant's shared decision. Prints one
//! JSON line: requests, allowed, errors, requests/s, p50 and p99 in
//! microseconds.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // A load tool: timing is its job.

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// What one client saw.
#[derive(Default)]
struct Tally {
    /// Latency of every answered request, in microseconds.
    micros: Vec<u32>,
    /// Answers that admitted the request.
    allowed: u64,
    /// Requests that failed (transport errors, unexpected statuses).
    errors: u64,
}

impl Tally {
    fn record(&mut self, started: Instant, allowed: bool) {
        self.micros
            .push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
        self.allowed += u64::from(allowed);
    }
}

/// Request `i` of client `client` of `clients`: its tenant key.
fn tenant(client: usize, i: usize, clients: usize, tenants: usize) -> String {
    format!("t{}", (client + i * clients) % tenants)
}

async fn rls(
    channel: Channel,
    client: usize,
    clients: usize,
    tenants: usize,
    until: Instant,
) -> Tally {
    let mut c = RateLimitServiceClient::new(channel);
    let mut tally = Tally::default();
    let mut i = 0;
    while Instant::now() < until {
        let request = RateLimitRequest {
            domain: "bench".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![
                    Entry {
                        key: "api_key".into(),
                        value: tenant(client, i, clients, tenants),
                    },
                    Entry {
                        key: "route".into(),
                        value: "bench".into(),
                    },
                ],
                ..Default::default()
            }],
            hits_addend: 1,
        };
        let started = Instant::now();
        match c.should_rate_limit(request).await {
            Ok(res) => tally.record(started, res.into_inner().overall_code == Code::Ok as i32),
            Err(_) => tally.errors += 1,
        }
        i += 1;
    }
    tally
}

async fn http(
    addr: String,
    check: bool,
    client: usize,
    clients: usize,
    tenants: usize,
    until: Instant,
) -> Tally {
    let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (mut sender, connection) = http1::handshake::<_, String>(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let path = if check { "/v1/auth" } else { "/" };
    let mut tally = Tally::default();
    let mut i = 0;
    while Instant::now() < until {
        let request = hyper::Request::get(path)
            .header("host", &addr)
            .header("x-api-key", tenant(client, i, clients, tenants))
            .header("x-tollgate-route", "bench")
            .body(String::new())
            .unwrap();
        let started = Instant::now();
        match sender.send_request(request).await {
            Ok(res) => {
                let status = res.status();
                drain(res.into_body()).await;
                match status.as_u16() {
                    200 => tally.record(started, true),
                    403 | 429 => tally.record(started, false),
                    _ => tally.errors += 1,
                }
            }
            Err(_) => {
                tally.errors += 1;
                break;
            }
        }
        i += 1;
    }
    tally
}

/// Reads a response body to its end.
async fn drain(mut body: Incoming) {
    use hyper::body::Body as _;
    while let Some(frame) =
        std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await
    {
        if frame.is_err() {
            return;
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let (target, addr, clients, seconds, tenants, streams) = match args.as_slice() {
        [target, addr, clients, seconds, tenants] => (target, addr, clients, seconds, tenants, "1"),
        [target, addr, clients, seconds, tenants, streams] => {
            (target, addr, clients, seconds, tenants, streams.as_str())
        }
        _ => {
            eprintln!("usage: entry_load <rls|check|proxy> ADDR CLIENTS SECONDS TENANTS [STREAMS]");
            std::process::exit(2);
        }
    };
    let clients: usize = clients.parse().unwrap();
    let streams: usize = streams.parse::<usize>().unwrap().max(1);
    assert!(
        streams == 1 || target == "rls",
        "only rls shares a connection between clients (HTTP/2)"
    );
    let tenants: usize = tenants.parse().unwrap();
    let seconds: u64 = seconds.parse().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let tallies = runtime.block_on(async {
        let mut channels = Vec::new();
        if target == "rls" {
            for _ in 0..clients.div_ceil(streams) {
                let endpoint = Endpoint::from_shared(format!("http://{addr}")).unwrap();
                channels.push(endpoint.connect().await.unwrap());
            }
        }
        let started = Instant::now();
        let until = started + Duration::from_secs(seconds);
        let tasks: Vec<_> = (0..clients)
            .map(|client| {
                let addr = addr.clone();
                match target.as_str() {
                    "rls" => {
                        let channel = channels[client / streams].clone();
                        tokio::spawn(rls(channel, client, clients, tenants, until))
                    }
                    "check" => tokio::spawn(http(addr, true, client, clients, tenants, until)),
                    "proxy" => tokio::spawn(http(addr, false, client, clients, tenants, until)),
                    other => panic!("unknown target {other}"),
                }
            })
            .collect();
        let mut tallies = Vec::new();
        for task in tasks {
            tallies.push(task.await.unwrap());
        }
        (tallies, started.elapsed())
    });
    let (tallies, elapsed) = tallies;
    let mut micros: Vec<u32> = tallies
        .iter()
        .flat_map(|t| t.micros.iter().copied())
        .collect();
    micros.sort_unstable();
    let at = |q: f64| {
        micros
            .get(((micros.len() as f64 * q) as usize).min(micros.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let requests = micros.len();
    println!(
        "{{\"target\":\"{target}\",\"clients\":{clients},\"streams_per_connection\":{streams},\"tenants\":{tenants},\"requests\":{requests},\
         \"allowed\":{},\"errors\":{},\"per_second\":{:.0},\"p50_us\":{},\"p99_us\":{}}}",
        tallies.iter().map(|t| t.allowed).sum::<u64>(),
        tallies.iter().map(|t| t.errors).sum::<u64>(),
        requests as f64 / elapsed.as_secs_f64(),
        at(0.5),
        at(0.99),
    );
}
