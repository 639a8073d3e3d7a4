//! The `fencegate` command: parse, initialise tracing, run.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fencegate::config::{Config, Overrides};
use fencegate::Gateway;

#[derive(Parser)]
#[command(
    name = "fencegate",
    version,
    about = "A fenced storage gateway: leases plus a durable fencing-token table in front of your storage."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (no arguments: the embedded defaults).
    Serve(ServeArgs),
    /// Validate a config file and say precisely what is wrong with it.
    CheckConfig {
        /// The TOML file to check.
        file: PathBuf,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// RocksDB and the built-in object store live here [default: ./fencegate-data].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Proxy (data plane) address [default: 127.0.0.1:8080].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// API (control plane) address [default: 127.0.0.1:7070].
    #[arg(long)]
    api_listen: Option<SocketAddr>,
    /// One catch-all route to this upstream (http://… or file://DIR).
    #[arg(long)]
    upstream: Option<String>,
    /// TOML config file; flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Log filter when RUST_LOG is unset (e.g. info, debug, fencegate=trace).
    #[arg(long)]
    log_level: Option<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { file } => check_config(&file),
        Command::Serve(args) => serve(args),
    }
}

fn check_config(file: &std::path::Path) -> ExitCode {
    match Config::load(file).and_then(|c| c.validate().map(|()| c)) {
        Ok(c) => {
            println!(
                "{}: ok ({} route(s), proxy {}, api {})",
                file.display(),
                c.effective_routes().len(),
                c.listen,
                c.api_listen
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}: {e}", file.display());
            ExitCode::from(2)
        }
    }
}

fn init_tracing(cfg: &Config) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.log_level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if cfg.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn serve(args: ServeArgs) -> ExitCode {
    let mut cfg = match &args.config {
        Some(path) => match Config::load(path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("fencegate: {e}");
                return ExitCode::from(2);
            }
        },
        None => Config::default(),
    };
    cfg.apply(Overrides {
        data_dir: args.data_dir,
        listen: args.listen,
        api_listen: args.api_listen,
        upstream: args.upstream,
        log_level: args.log_level,
    });
    if let Err(e) = cfg.validate() {
        eprintln!("fencegate: invalid configuration: {e}");
        return ExitCode::from(2);
    }
    init_tracing(&cfg);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fencegate: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let gateway = match Gateway::start(cfg).await {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(error = %e, "fencegate could not start");
                return ExitCode::FAILURE;
            }
        };
        fencegate::shutdown::os_signal().await;
        tracing::info!("shutdown signal received; draining");
        gateway.shutdown();
        gateway.wait().await;
        tracing::info!("fencegate stopped");
        ExitCode::SUCCESS
    })
}
