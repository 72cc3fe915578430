use super::*;

const MINIMAL: &str = r#"
[[routes]]
id = "create-order"
methods = ["POST"]
path_prefix = "/orders"
upstream = "http://127.0.0.1:9000"
"#;

fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn problems(contents: &str, vars: &[(&str, &str)]) -> Vec<String> {
    match load(contents, &env(vars)) {
        Ok(_) => panic!("expected the config to be rejected"),
        Err(e) => e.problems(),
    }
}

#[test]
fn defaults_match_the_interface_contract() {
    let config = load(MINIMAL, &BTreeMap::new()).unwrap();
    assert_eq!(config.server.listen.to_string(), "0.0.0.0:8080");
    assert_eq!(config.server.admin_listen.to_string(), "127.0.0.1:9091");
    assert_eq!(config.server.workers, 2);
    assert_eq!(
        config.redis.target,
        RedisTarget::Single("redis://127.0.0.1:6379".into())
    );
    assert_eq!(config.redis.timeout, std::time::Duration::from_millis(5));
    assert_eq!(
        config.rules.source,
        RuleSource::File("config/rules.toml".into())
    );
    assert_eq!(config.rules.refresh.as_secs(), 30);
    assert_eq!(config.default_rule.capacity.get(), 20);
    assert_eq!(config.default_rule.refill_per_second.get(), 10);
    assert!(config.admin.token.is_none());
    assert_eq!(
        config.upstream.idle_timeout,
        std::time::Duration::from_secs(4)
    );
    let route = &config.routes[0];
    assert_eq!(route.id.as_str(), "create-order");
    assert_eq!(route.methods, vec![hyper::Method::POST]);
    assert_eq!(route.upstream_origin, "http://127.0.0.1:9000");
    assert_eq!(route.cost.get(), 1);
}

#[test]
fn shipped_config_files_are_valid() {
    for file in ["config/tollgate.toml", "config/demo.toml"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
        if let Err(e) = load_file(&path, &BTreeMap::new()) {
            panic!("{file}: {e}");
        }
    }
}

#[test]
fn environment_overrides_keys_with_the_schema_type() {
    let config = load(
        MINIMAL,
        &env(&[
            ("TOLLGATE__REDIS__URL", ""),
            ("TOLLGATE__SERVER__WORKERS", "4"),
            ("TOLLGATE__INSTANCE__ID", "1234"),
            ("TOLLGATE__ROUTES__0__UPSTREAM", "http://10.0.0.1:81/base/"),
            ("TOLLGATE__ROUTES__0__METHODS", "get, post"),
            ("TOLLGATE__UPSTREAM__IDLE_TIMEOUT_MS", "60000"),
            ("OTHER_VARIABLE", "ignored"),
        ]),
    )
    .unwrap();
    assert_eq!(config.redis.target, RedisTarget::LocalOnly);
    assert_eq!(config.server.workers, 4);
    assert_eq!(config.instance.id, "1234");
    assert_eq!(config.routes[0].upstream_origin, "http://10.0.0.1:81");
    assert_eq!(config.routes[0].upstream_base_path, "/base");
    assert_eq!(config.routes[0].methods.len(), 2);
    assert_eq!(
        config.upstream.idle_timeout,
        std::time::Duration::from_secs(60)
    );
}

#[test]
fn cluster_nodes_from_the_environment_switch_to_cluster_mode() {
    let config = load(
        MINIMAL,
        &env(&[(
            "TOLLGATE__REDIS__CLUSTER_NODES",
            r#"["127.0.0.1:7001", "127.0.0.1:7002"]"#,
        )]),
    )
    .unwrap();
    assert_eq!(
        config.redis.target,
        RedisTarget::Cluster(vec![
            "redis://127.0.0.1:7001".into(),
            "redis://127.0.0.1:7002".into()
        ])
    );
}

#[test]
fn a_dropped_entry_is_reported_once_and_later_routes_keep_their_index() {
    let contents = r#"
[[routes]]
id = 5
upstream = "http://a:1"
path_prefix = "/"

[[routes]]
id = "ok"
upstream = "http://a:1"
path_prefix = "/"
cost = 0
"#;
    assert_eq!(
        problems(contents, &[]),
        vec![
            "routes[0].id: expected a string, found an integer",
            "routes[1].cost: must be between 1 and 2147483647, found 0",
        ]
    );
    assert_eq!(
        problems("routes = \"x\"\n", &[]),
        vec!["routes: must be an array of [[routes]] tables"]
    );
}

#[test]
fn every_problem_is_reported_at_once() {
    let contents = r#"
[server]
listen = "nowhere"
workers = "two"
colour = "blue"

[redis]
timeout_ms = 0

[default_rule]
capacity = -1
refill_per_second = 3000000000

[bogus]
x = 1

[[routes]]
id = "bad{id}"
path_prefix = "orders"
upstream = "ftp://x"
cost = 0

[[routes]]
id = "dup"
upstream = "http://a:1"
path_prefix = "/"

[[routes]]
id = "dup"
upstream = "http://a:1"
path_prefix = "/"
methods = ["NOT A METHOD"]
"#;
    // Shape problems (unknown keys, wrong types) first, then the values of
    // every other key, all from one run.
    let all = problems(contents, &[("TOLLGATE__SERVER__NOPE", "1")]);
    assert_eq!(
        all[..4],
        [
            "TOLLGATE__SERVER__NOPE: no config key server.nope",
            "bogus: unknown section",
            "server.colour: unknown key",
            "server.workers: expected an integer, found a string",
        ],
        "{all:#?}"
    );
    let keys: Vec<&str> = all[4..]
        .iter()
        .map(|p| p.split(':').next().unwrap())
        .collect();
    assert_eq!(
        keys,
        vec![
            "server.listen",
            "redis.timeout_ms",
            "default_rule.capacity",
            "default_rule.refill_per_second",
            "routes[0].id",
            "routes[0].path_prefix",
            "routes[0].upstream",
            "routes[0].cost",
            "routes[2].id",
            "routes[2].methods",
        ],
        "{all:#?}"
    );
}

#[test]
fn bad_environment_values_name_the_variable() {
    let found = problems(
        MINIMAL,
        &[
            ("TOLLGATE__REDIS__TIMEOUT_MS", "fast"),
            ("TOLLGATE__ROUTES__3__COST", "2"),
            ("TOLLGATE__NOSECTION", "x"),
        ],
    );
    assert_eq!(
        found,
        vec![
            "TOLLGATE__NOSECTION: expected TOLLGATE__<SECTION>__<KEY>",
            "TOLLGATE__REDIS__TIMEOUT_MS: expected an integer, found \"fast\"",
            "TOLLGATE__ROUTES__3__COST: no such [[routes]] entry in the file",
        ]
    );
}

#[test]
fn a_config_without_routes_is_rejected() {
    assert_eq!(
        problems("", &[]),
        vec!["routes: at least one [[routes]] entry is required"]
    );
}

#[test]
fn toml_syntax_errors_are_reported() {
    let err = load("[server\nlisten=", &BTreeMap::new()).unwrap_err();
    assert!(matches!(err, ConfigError::Syntax(_)), "{err}");
}

#[test]
fn path_prefixes_are_normalised() {
    let config = load(
        &MINIMAL.replace("\"/orders\"", "\"/orders/\""),
        &BTreeMap::new(),
    )
    .unwrap();
    assert_eq!(config.routes[0].path_prefix, "/orders");
}

#[test]
fn a_database_url_switches_rules_to_postgresql() {
    let config = load(
        MINIMAL,
        &env(&[
            (
                "TOLLGATE__RULES__DATABASE_URL",
                "postgres://gw@127.0.0.1:5432/gw",
            ),
            ("TOLLGATE__RULES__MIGRATE_ON_START", "false"),
            ("TOLLGATE__RULES__SNAPSHOT_FILE", ""),
        ]),
    )
    .unwrap();
    assert_eq!(
        config.rules.source,
        RuleSource::Database("postgres://gw@127.0.0.1:5432/gw".into())
    );
    assert!(!config.rules.migrate_on_start);
    assert!(config.rules.snapshot_file.is_none());

    let bad = problems(MINIMAL, &[("TOLLGATE__RULES__DATABASE_URL", "mysql://x/y")]);
    assert_eq!(bad.len(), 1);
    assert!(bad[0].starts_with("rules.database_url:"), "{bad:?}");
}

#[test]
fn passwords_in_urls_are_redacted() {
    use super::redact_url;
    assert_eq!(
        redact_url("redis://:s3cret@h:6379/0"),
        "redis://:***@h:6379/0"
    );
    assert_eq!(
        redact_url("postgres://gw:p%40ss@db:5432/gw?sslmode=require"),
        "postgres://gw:***@db:5432/gw?sslmode=require"
    );
    assert_eq!(redact_url("redis://user@h:6379"), "redis://user@h:6379");
    assert_eq!(
        redact_url("redis://u:ab#c/d?e@f@h:6379/0"),
        "redis://u:***@h:6379/0"
    );
    assert_eq!(
        redact_url("redis://127.0.0.1:6379"),
        "redis://127.0.0.1:6379"
    );
    assert_eq!(redact_url("http://h/a@b"), "http://h/a@b");
    assert_eq!(redact_url("not a url"), "not a url");
}

#[test]
fn the_reference_page_and_the_reference_file_document_every_key() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    let reference = std::fs::read_to_string(root.join("config/tollgate.toml")).unwrap();
    // The keys of `[section]` in the reference file, up to the next header.
    let keys_in = |section: &str| -> Vec<String> {
        let header = format!("[{section}]");
        reference
            .lines()
            .skip_while(|l| !l.trim_start().starts_with(&header))
            .skip(1)
            .take_while(|l| !l.trim_start().starts_with('['))
            .filter_map(|l| l.split_once('=').map(|(k, _)| k.trim().to_owned()))
            .filter(|k| !k.starts_with('#'))
            .collect()
    };
    let schema = Schema::new();
    let mut missing = Vec::new();
    for (section, keys) in &schema.root {
        let Some(keys) = keys.as_table() else {
            continue;
        };
        let documented = keys_in(section);
        for key in keys.keys() {
            let name = format!("{section}.{key}");
            if !readme.contains(&format!("`{name}`")) {
                missing.push(format!("docs/configuration.md: {name}"));
            }
            if !documented.contains(key) {
                missing.push(format!("config/tollgate.toml: {name}"));
            }
        }
    }
    let route_keys = keys_in("[routes]");
    for key in schema.route.keys() {
        if !readme.contains(&format!("`routes[].{key}`")) {
            missing.push(format!("docs/configuration.md: routes[].{key}"));
        }
        if !route_keys.contains(key) {
            missing.push(format!("config/tollgate.toml: routes[].{key}"));
        }
    }
    assert!(missing.is_empty(), "undocumented keys: {missing:#?}");
}

#[test]
fn listen_addresses_may_name_a_host() {
    let config = load(
        &format!(
            "[server]\nlisten = \"localhost:8080\"\nadmin_listen = \"localhost:0\"\n{MINIMAL}"
        ),
        &BTreeMap::new(),
    )
    .unwrap();
    assert_eq!(config.server.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(config.server.admin_listen.to_string(), "127.0.0.1:0");
    for (value, message) in [
        ("8080", "expected ip:port or host:port"),
        ("localhost:http", "expected ip:port or host:port"),
        (":8080", "expected ip:port or host:port"),
        (
            "no-such-host.invalid:80",
            "cannot resolve host \"no-such-host.invalid\"",
        ),
    ] {
        let found = problems(&format!("[server]\nlisten = \"{value}\"\n{MINIMAL}"), &[]);
        assert!(
            found.len() == 1
                && found[0].starts_with("server.listen: ")
                && found[0].contains(message),
            "{value}: {found:?}"
        );
    }
}

#[test]
fn a_mistyped_key_or_section_gets_the_closest_name() {
    let found = problems(
        &format!(
            "[server]\nlisen = \"127.0.0.1:1\"\ncolour = 1\n[redis]\nurl = \"\"\ntimeout_msec = 5\n[breakr]\n{MINIMAL}"
        ),
        &[("TOLLGATE__REDIS__TIMEOUTMS", "5")],
    );
    assert_eq!(
        found,
        [
            "TOLLGATE__REDIS__TIMEOUTMS: no config key redis.timeoutms; did you mean \"redis.timeout_ms\"?",
            "breakr: unknown section; did you mean \"breaker\"?",
            "redis.timeout_msec: unknown key; did you mean \"timeout_ms\"?",
            "server.colour: unknown key",
            "server.lisen: unknown key; did you mean \"listen\"?",
        ]
    );
}

#[test]
fn edit_distance_counts_single_character_edits() {
    assert_eq!(edit_distance("listen", "listen"), 0);
    assert_eq!(edit_distance("lisen", "listen"), 1);
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(edit_distance("", "abc"), 3);
    assert_eq!(edit_distance("abc", ""), 3);
}

#[test]
fn an_https_upstream_needs_a_loadable_ca_file() {
    let route =
        "[[routes]]\nid = \"a\"\npath_prefix = \"/\"\nupstream = \"https://example.com/v1\"\n";
    let config = load(route, &BTreeMap::new()).unwrap();
    assert_eq!(config.routes[0].upstream_origin, "https://example.com");
    assert_eq!(config.routes[0].upstream_base_path, "/v1");
    assert!(config.routes[0].is_tls());

    let found = problems(
        &format!("[upstream]\nca_file = \"/nonexistent/ca.pem\"\n{route}"),
        &[],
    );
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("upstream.ca_file: /nonexistent/ca.pem: "),
        "{found:?}"
    );
    let found = problems(&route.replace("https://", "ftp://"), &[]);
    assert_eq!(
        found,
        [
            "routes[0].upstream: expected http[s]://host[:port][/base-path], found \"ftp://example.com/v1\""
        ]
    );
}

#[test]
fn listener_tls_needs_both_files_and_they_must_load() {
    let found = problems(
        &format!("[server]\ntls_cert_file = \"cert.pem\"\n{MINIMAL}"),
        &[],
    );
    assert_eq!(
        found,
        ["server.tls_key_file: must be set with server.tls_cert_file"]
    );
    let found = problems(
        &format!(
            "[server]\ntls_cert_file = \"/nonexistent/c.pem\"\ntls_key_file = \"/nonexistent/k.pem\"\n{MINIMAL}"
        ),
        &[],
    );
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("server.tls_cert_file: /nonexistent/c.pem: "),
        "{found:?}"
    );
}

#[test]
fn an_https_upstream_host_must_be_a_certificate_name() {
    let route = "[[routes]]\nid = \"a\"\npath_prefix = \"/\"\nupstream = \"https://-x.com\"\n";
    assert_eq!(
        problems(route, &[]),
        [
            "routes[0].upstream: \"-x.com\" cannot be checked against a certificate: invalid dns name"
        ]
    );
    // Plain http:// needs no such name.
    load(&route.replace("https", "http"), &BTreeMap::new()).unwrap();
}

#[test]
fn in_flight_bounds_are_held_to_half_the_upstream_pool() {
    let config = load(MINIMAL, &BTreeMap::new()).unwrap();
    assert_eq!(config.upstream.max_connections_per_tenant, 64);
    assert_eq!(config.upstream.max_connections_without_rule, 128);
    assert!(config.notes.is_empty(), "{:?}", config.notes);
    let config = load(
        &format!("[upstream]\nmax_connections_per_worker = 8\n{MINIMAL}"),
        &BTreeMap::new(),
    )
    .unwrap();
    assert_eq!(config.upstream.max_connections_per_tenant, 4);
    assert_eq!(config.upstream.max_connections_without_rule, 4);
    assert_eq!(config.notes.len(), 2, "{:?}", config.notes);
    assert!(
        config.notes[1]
            .starts_with("upstream.max_connections_without_rule = 128 is more than half")
    );
    let one = load(
        &format!("[upstream]\nmax_connections_per_worker = 1\n{MINIMAL}"),
        &BTreeMap::new(),
    )
    .unwrap();
    assert_eq!(
        one.upstream.max_connections_per_tenant, 1,
        "never below one"
    );
}

#[test]
fn http2_and_body_budget_keys_are_checked_against_each_other() {
    let contents = format!(
        "{MINIMAL}\n[client]\nheader_timeout_ms = 5000\nh2_idle_timeout_ms = 5000\n\
         h2_max_concurrent_streams = 0\nbody_buffer_bytes_per_connection = 65540\n\
         body_buffer_bytes = 100000\n"
    );
    let all = problems(&contents, &[]);
    for (key, message) in [
        (
            "client.h2_idle_timeout_ms",
            "must be longer than client.header_timeout_ms (5000 ms)",
        ),
        ("client.h2_max_concurrent_streams", "must be between 1 and"),
        (
            "client.body_buffer_bytes_per_connection",
            "must be between 65541 and",
        ),
    ] {
        assert!(
            all.iter().any(|p| p.contains(key) && p.contains(message)),
            "{key}: {all:#?}"
        );
    }
    let all = problems(
        &format!(
            "{MINIMAL}\n[client]\nbody_buffer_bytes_per_connection = 200000\nbody_buffer_bytes = 100000\n"
        ),
        &[],
    );
    assert!(
        all.iter()
            .any(|p| p.contains("client.body_buffer_bytes") && p.contains("at least")),
        "{all:#?}"
    );
    let config = load(MINIMAL, &BTreeMap::new()).unwrap();
    assert_eq!(config.client.h2_idle_timeout.as_secs(), 300);
    assert_eq!(config.client.body_buffer_bytes, 64 << 20);
}

#[test]
fn relative_paths_follow_the_config_file_unless_only_the_working_directory_has_them() {
    let dir = std::env::temp_dir().join(format!("tollgate-paths-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("here")).unwrap();
    std::fs::write(dir.join("here/rules.toml"), "").unwrap();
    let config_path = dir.join("gateway.toml");
    // rules.toml is next to nothing in the working directory but is in
    // the file's; Cargo.toml is in the working directory (the crate's)
    // alone; the snapshot exists nowhere yet.
    std::fs::write(
        &config_path,
        format!(
            "{MINIMAL}\n[rules]\nfile = \"here/rules.toml\"\nsnapshot_file = \"state/snap.json\"\n\
             [upstream]\nca_file = \"\"\n[server]\ntls_cert_file = \"\"\ntls_key_file = \"\"\n"
        ),
    )
    .unwrap();
    let config = load_file(&config_path, &BTreeMap::new()).unwrap();
    assert_eq!(
        config.rules.source,
        RuleSource::File(dir.join("here/rules.toml"))
    );
    assert_eq!(
        config.rules.snapshot_file.as_deref(),
        Some(dir.join("state/snap.json").as_path())
    );
    let old_style = format!("{MINIMAL}\n[rules]\nfile = \"Cargo.toml\"\n");
    std::fs::write(&config_path, old_style).unwrap();
    let config = load_file(&config_path, &BTreeMap::new()).unwrap();
    assert_eq!(
        config.rules.source,
        RuleSource::File(std::path::PathBuf::from("Cargo.toml"))
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn descriptor_entry_keys_each_mean_one_thing_and_slot_leases_are_bounded() {
    let config = load(MINIMAL, &BTreeMap::new()).unwrap();
    assert_eq!(config.slot_lease, std::time::Duration::from_secs(10));
    let clashing = format!(
        "{MINIMAL}[rls]\nlisten = \"127.0.0.1:8081\"\nrequest_id_key = \"api_key\"\n\
         release_key = \"charge\"\n[limits]\nslot_lease_ms = 100\n"
    );
    let found = problems(&clashing, &[]);
    for expected in [
        "rls.request_id_key: must differ from rls.tenant_key",
        "rls.release_key: must differ from rls.charge_key",
        "limits.slot_lease_ms",
    ] {
        assert!(
            found.iter().any(|p| p.contains(expected)),
            "{expected} not in {found:?}"
        );
    }
}
