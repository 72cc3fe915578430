//! The `tollgate` command line: `serve`, `demo` and `check-config`.
//!
//! Parses arguments, loads and checks configuration (exit code 64 on any
//! problem, before a port is bound), and hands over to the library.

// deny, not forbid: the allocator module alone needs unsafe.
#![deny(unsafe_code)]

mod allocator;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tollgate::config::{self, Config};
use tollgate::{app, demo, telemetry};

/// The heap allocator: mimalloc's thread-local free lists cost a proxied
/// request far fewer instructions than glibc malloc's arenas (see
/// docs/performance.md).
#[global_allocator]
static ALLOCATOR: allocator::MiMalloc = allocator::MiMalloc;

/// Exit code for invalid configuration.
const EXIT_CONFIG: u8 = 64;

/// Distributed rate limiter for API gateways.
#[derive(Parser)]
#[command(name = "tollgate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one gateway instance.
    Serve {
        /// Path to the TOML configuration.
        #[arg(long)]
        config: PathBuf,
    },
    /// Try tollgate locally: a gateway plus a built-in demo upstream.
    Demo,
    /// Validate a configuration and its rules file; print every problem.
    CheckConfig {
        /// Path to the TOML configuration.
        #[arg(long)]
        config: PathBuf,
    },
    /// Apply the SQL migrations (rate_limit_rule table and its triggers).
    Migrate {
        /// PostgreSQL URL, e.g. postgres://user:password@host:5432/database.
        #[arg(long)]
        database_url: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let env = config::process_env();
    let loaded = match &cli.command {
        Command::Serve { config } | Command::CheckConfig { config } => {
            config::load_file(config, &env)
        }
        Command::Demo => config::load(demo::DEMO_CONFIG, &env),
        Command::Migrate { database_url } => return migrate(database_url),
    };
    let mut config = match loaded {
        Ok(config) => config,
        Err(e) => return config_failure(&e.problems()),
    };
    match cli.command {
        Command::CheckConfig { config: path } => match app::check(&config) {
            Ok(rules) => {
                println!(
                    "{}: valid ({} routes, {rules})",
                    path.display(),
                    config.routes.len()
                );
                for note in &config.notes {
                    eprintln!("note: {note}");
                }
                ExitCode::SUCCESS
            }
            Err(problems) => config_failure(&problems),
        },
        Command::Migrate { .. } => unreachable!("handled before loading a config"),
        Command::Serve { .. } => serve(config),
        Command::Demo => {
            if let Err(e) = demo::without_rules_file(&mut config) {
                eprintln!("error: cannot make the demo's rules file: {e}");
                return ExitCode::FAILURE;
            }
            if let Err(problems) = app::check(&config) {
                return config_failure(&problems);
            }
            start_logging(&config);
            finish(actix_web::rt::System::new().block_on(demo::run(config)))
        }
    }
}

/// Checks the rules, binds, and runs until SIGINT/SIGTERM.
fn serve(config: Config) -> ExitCode {
    if let Err(problems) = app::check(&config) {
        return config_failure(&problems);
    }
    start_logging(&config);
    let listeners = match app::Listeners::bind(&config) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    finish(actix_web::rt::System::new().block_on(app::run(
        config,
        listeners,
        app::shutdown_signal(),
    )))
}

/// `tollgate migrate`: applies the migrations and reports the outcome.
fn migrate(url: &str) -> ExitCode {
    if let Err(message) = config::database_url(url) {
        return config_failure(&[format!("--database-url: {message}")]);
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return finish(Err(e.into())),
    };
    match rt.block_on(app::migrate(url)) {
        Ok(()) => {
            println!("Migrations applied.");
            ExitCode::SUCCESS
        }
        Err(e) => finish(Err(e.into())),
    }
}

fn start_logging(config: &Config) {
    if let Err(e) = telemetry::init_tracing(&config.log) {
        eprintln!("warning: logging not started: {e}");
    }
}

fn config_failure(problems: &[String]) -> ExitCode {
    eprintln!("error: invalid configuration:");
    for p in problems {
        eprintln!("  {p}");
    }
    ExitCode::from(EXIT_CONFIG)
}

fn finish(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
