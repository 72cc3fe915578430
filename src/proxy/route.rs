//! The route table: method + path → route.
//!
//! Owns matching. The longest matching path prefix wins (on whole path
//! segments), ties going to the route declared first; a route with no
//! methods accepts any method.

use hyper::Method;

use crate::config::RouteSpec;
use crate::telemetry::RouteMetrics;

/// A configured route with its metric handles.
pub struct Route {
    /// Position in the route table (indexes per-route counters).
    pub index: usize,
    /// Id, methods, prefix, upstream and cost.
    pub spec: RouteSpec,
    /// Pre-registered series for this route.
    pub metrics: RouteMetrics,
}

/// A client-sent `value` for a message: quoted, and cut to its first 64
/// bytes (a whole character) so an answer never echoes a flood.
pub fn quoted(value: &str) -> String {
    const SHOWN: usize = 64;
    if value.len() <= SHOWN {
        return format!("{value:?}");
    }
    let mut end = SHOWN;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &value[..end], value.len())
}

/// All routes, in config order.
pub struct RouteTable {
    /// Routes as declared.
    routes: Vec<Route>,
}

impl RouteTable {
    /// Builds the table and registers each route's metrics.
    pub fn new(specs: &[RouteSpec]) -> Self {
        Self {
            routes: specs
                .iter()
                .enumerate()
                .map(|(index, spec)| Route {
                    index,
                    metrics: RouteMetrics::new(&spec.id),
                    spec: spec.clone(),
                })
                .collect(),
        }
    }

    /// The route at `index` (its [`Route::index`]).
    pub fn get(&self, index: usize) -> Option<&Route> {
        self.routes.get(index)
    }

    /// The route whose id is `id` (a client's words), or a message saying
    /// there is none and which there are.
    ///
    /// # Errors
    /// When no route has that id.
    pub fn named(&self, id: &str) -> Result<&Route, String> {
        self.routes
            .iter()
            .find(|r| r.spec.id.as_str() == id)
            .ok_or_else(|| {
                let ids: Vec<&str> = self.routes.iter().map(|r| r.spec.id.as_str()).collect();
                format!("no route {} (routes: {})", quoted(id), ids.join(", "))
            })
    }

    /// The route serving `method` on `path`, if any.
    pub fn find(&self, method: &Method, path: &str) -> Option<&Route> {
        let mut best: Option<&Route> = None;
        for route in &self.routes {
            let spec = &route.spec;
            let method_ok = spec.methods.is_empty() || spec.methods.contains(method);
            if method_ok
                && prefix_matches(&spec.path_prefix, path)
                && best.is_none_or(|b| spec.path_prefix.len() > b.spec.path_prefix.len())
            {
                best = Some(route);
            }
        }
        best
    }
}

/// Whether `prefix` (no trailing slash, or exactly `/`) covers `path` on a
/// segment boundary.
fn prefix_matches(prefix: &str, path: &str) -> bool {
    if prefix == "/" {
        return true;
    }
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn client_values_are_quoted_and_cut_short() {
        assert_eq!(quoted("api"), "\"api\"");
        let long = "é".repeat(40);
        let shown = quoted(&long);
        assert!(
            shown.starts_with(&format!("\"{}\"…", "é".repeat(32))),
            "{shown}"
        );
        assert!(shown.ends_with("(80 bytes)"), "{shown}");
    }

    use super::*;
    use crate::key::RouteId;
    use std::num::NonZeroU32;

    fn spec(id: &str, methods: &[Method], prefix: &str) -> RouteSpec {
        RouteSpec {
            usage: None,
            id: RouteId::parse(id).unwrap(),
            methods: methods.to_vec(),
            path_prefix: prefix.to_owned(),
            upstream_origin: "http://127.0.0.1:1".into(),
            upstream_base_path: String::new(),
            cost: NonZeroU32::MIN,
        }
    }

    fn table() -> RouteTable {
        RouteTable::new(&[
            spec("catch-all", &[], "/"),
            spec("create-order", &[Method::POST], "/orders"),
            spec("read-order", &[Method::GET], "/orders"),
            spec("order-items", &[], "/orders/items"),
        ])
    }

    fn id(t: &RouteTable, m: Method, p: &str) -> Option<String> {
        t.find(&m, p).map(|r| r.spec.id.to_string())
    }

    #[test]
    fn longest_prefix_and_method_pick_the_route() {
        let t = table();
        for (method, path, route) in [
            (Method::POST, "/orders", "create-order"),
            (Method::GET, "/orders/7", "read-order"),
            (Method::DELETE, "/orders/items/3", "order-items"),
            (Method::DELETE, "/orders/7", "catch-all"),
        ] {
            assert_eq!(id(&t, method, path).as_deref(), Some(route), "{path}");
        }
    }

    #[test]
    fn prefixes_match_whole_segments_only() {
        assert!(prefix_matches("/orders", "/orders"));
        assert!(prefix_matches("/orders", "/orders/"));
        assert!(!prefix_matches("/orders", "/orders7"));
        assert!(!prefix_matches("/orders", "/order"));
        let t = RouteTable::new(&[spec("o", &[], "/orders")]);
        assert!(t.find(&Method::GET, "/ordersX").is_none());
    }
}
