//! The `fencegate` command: parse, initialise tracing, run.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use std::time::Duration;

use clap::{Parser, Subcommand};
use fencegate::client::Client;
use fencegate::config::{Config, Overrides};
use fencegate::Gateway;

mod cmd;

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
    /// Print the SHA-256 of a bearer token, for `token_sha256` in a
    /// principals file (reads the token from stdin when none is given).
    HashToken { token: Option<String> },
    /// Cluster mode, operator tasks.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Validate a config file and say precisely what is wrong with it.
    CheckConfig {
        /// The TOML file to check.
        file: PathBuf,
    },
    /// Acquire a lock once and print the grant as JSON (no renewal).
    Acquire {
        key: String,
        /// Lease length (500ms, 30s, 2m).
        #[arg(long, default_value = "30s", value_parser = cmd::parse_duration)]
        ttl: Duration,
        /// How long to wait in the queue.
        #[arg(long, default_value = "0s", value_parser = cmd::parse_duration)]
        wait: Duration,
        #[arg(long, default_value = "")]
        holder: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Renew a lease. The lease id is a secret: rather than on the command
    /// line (which other local users can read), pass it in FENCEGATE_LEASE_ID
    /// or on stdin (omit LEASE_ID, or give `-`).
    Renew {
        key: String,
        /// The lease id [default: $FENCEGATE_LEASE_ID, else one line of stdin].
        #[arg(env = "FENCEGATE_LEASE_ID", hide_env_values = true)]
        lease_id: Option<String>,
        /// A new lease length.
        #[arg(long, value_parser = cmd::parse_duration)]
        ttl: Option<Duration>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Release a lease. The lease id comes as for `renew`: FENCEGATE_LEASE_ID
    /// or stdin rather than the command line.
    Release {
        key: String,
        /// The lease id [default: $FENCEGATE_LEASE_ID, else one line of stdin].
        #[arg(env = "FENCEGATE_LEASE_ID", hide_env_values = true)]
        lease_id: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Print a key's fence and holder.
    Status {
        key: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Wait until a key's holder changes from token AFTER (0: nobody).
    Watch {
        key: String,
        #[arg(long, default_value_t = 0)]
        after: u64,
        #[arg(long, default_value = "30s", value_parser = cmd::parse_duration)]
        timeout: Duration,
        #[command(flatten)]
        conn: Conn,
    },
    /// Run a command while holding a lock: FENCING_TOKEN, FENCEGATE_KEY and
    /// FENCEGATE_URL in its environment (FENCEGATE_TOKEN and
    /// FENCEGATE_LEASE_ID are removed from it); renewed while it runs;
    /// stopped (SIGTERM, then SIGKILL after --grace) if the lock is lost.
    Lock {
        key: String,
        #[arg(long, default_value = "30s", value_parser = cmd::parse_duration)]
        ttl: Duration,
        #[arg(long, default_value = "1m", value_parser = cmd::parse_duration)]
        wait: Duration,
        #[arg(long, default_value = "")]
        holder: String,
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        conn: Conn,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Wait to become leader of NAME, then run a command as `lock` does.
    Elect {
        name: String,
        #[arg(long)]
        candidate: String,
        #[arg(long, default_value = "10s", value_parser = cmd::parse_duration)]
        ttl: Duration,
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        conn: Conn,
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
}

#[derive(clap::Args)]
struct Conn {
    /// The gateway's api listener.
    #[arg(long, env = "FENCEGATE_URL", default_value = "http://127.0.0.1:7070")]
    url: String,
    /// Bearer token of your principal. A secret: prefer FENCEGATE_TOKEN, or
    /// `--token -` to read it from one line of stdin; a value given here is
    /// visible to other local users (ps, /proc).
    #[arg(long, env = "FENCEGATE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// CA bundle (PEM) to trust for an https:// --url (default: system roots).
    #[arg(long, env = "FENCEGATE_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// Client certificate chain (PEM) for mTLS.
    #[arg(long, env = "FENCEGATE_CLIENT_CERT", requires = "client_key")]
    client_cert: Option<PathBuf>,
    /// Client private key (PEM) for mTLS.
    #[arg(long, env = "FENCEGATE_CLIENT_KEY", requires = "client_cert")]
    client_key: Option<PathBuf>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Time between SIGTERM and SIGKILL when the lock is lost.
    #[arg(long, default_value = "10s", value_parser = cmd::parse_duration)]
    grace: Duration,
    /// Start a loopback proxy that adds X-Fencing-Token to every request of
    /// the command (HTTP_PROXY, http_proxy, AWS_ENDPOINT_URL and
    /// FENCEGATE_PROXY_URL point at it).
    #[arg(long)]
    inject: bool,
    /// The gateway's proxy listener, where injected requests go.
    #[arg(long, env = "FENCEGATE_PROXY", default_value = "http://127.0.0.1:8080")]
    proxy: String,
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// After an etcd restore (or a move to a new etcd cluster): make every
    /// token issued from now on greater than N — the token floor the
    /// gateways' refusal names. Never lowers anything.
    RaiseFloor {
        /// The etcd endpoints (URL[,URL…]).
        #[arg(long, value_delimiter = ',', required = true)]
        etcd: Vec<String>,
        /// The key prefix of the cluster in etcd.
        #[arg(long, default_value = "/fencegate/")]
        prefix: String,
        /// Every new token will be greater than this.
        #[arg(long)]
        to: u64,
        /// Raft entries (failed transactions, no revision) added after the
        /// offset is written, before etcd's raft index is recorded again: a
        /// restore of a backup taken after this run is then found until that
        /// many such entries were made on the restored cluster. Padding
        /// hides, for as many entries, a restore not yet raised of any other
        /// deployment on this etcd (one started after the backup too): use
        /// it only where none can be (docs/cluster.md, e.g. 10000).
        #[arg(long, default_value_t = 0)]
        raft_pad: u64,
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
    /// Log format: text or json (one JSON object per line).
    #[arg(long, value_parser = ["text", "json"])]
    log_format: Option<String>,
    /// Cluster mode: share the authority with other gateways through these
    /// etcd endpoints (URL[,URL…]).
    #[arg(long, value_delimiter = ',')]
    etcd: Option<Vec<String>>,
}

/// mimalloc rather than the system allocator: every request allocates a
/// few small objects (its future, JSON, headers), and glibc's malloc spent
/// ~4% of a lock cycle's CPU on them (consolidating fast bins on each
/// allocation over 1 KiB among it); mimalloc took ~5% off the cycle.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { file } => check_config(&file),
        Command::Serve(args) => serve(args),
        Command::HashToken { token } => hash_token(token),
        Command::Cluster(c) => cluster_command(c),
        other => client_command(other),
    }
}

fn cluster_command(c: ClusterCommand) -> ExitCode {
    let ClusterCommand::RaiseFloor { etcd, prefix, to, raft_pad } = c;
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fencegate: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut cfg = fencegate::config::ClusterConfig::with_endpoints(etcd);
    cfg.prefix = prefix;
    match runtime.block_on(fencegate::cluster::raise_floor(&cfg, to, raft_pad)) {
        Ok(r) => {
            println!(
                "{}",
                serde_json::json!({
                    "offset": r.offset,
                    "floor": to,
                    "grants_ended": r.grants_ended,
                    "fences_raised": r.fences_raised,
                    "raft_padded": r.raft_padded,
                })
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fencegate: raising the token floor: {e}");
            ExitCode::FAILURE
        }
    }
}

fn hash_token(token: Option<String>) -> ExitCode {
    let token = match token {
        Some(t) => t,
        None => {
            let mut line = String::new();
            if std::io::stdin().read_line(&mut line).is_err() {
                return ExitCode::from(cmd::EXIT_USAGE);
            }
            line.trim_end_matches(['\r', '\n']).to_string()
        }
    };
    println!("{}", fencegate::auth::hash_token(&token));
    ExitCode::SUCCESS
}

fn client_command(command: Command) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fencegate: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let conn = match &command {
            Command::Acquire { conn, .. }
            | Command::Renew { conn, .. }
            | Command::Release { conn, .. }
            | Command::Status { conn, .. }
            | Command::Watch { conn, .. }
            | Command::Lock { conn, .. }
            | Command::Elect { conn, .. } => conn,
            Command::Serve(_) | Command::CheckConfig { .. } | Command::HashToken { .. } | Command::Cluster(_) => {
                return ExitCode::from(cmd::EXIT_USAGE)
            }
        };
        // Secrets may come from stdin (`--token -`, LEASE_ID omitted or `-`).
        let mut stdin_used = false;
        let token = match conn.token.as_deref() {
            Some("-") => match secret_from_stdin("--token", &mut stdin_used) {
                Ok(t) => Some(t),
                Err(code) => return code,
            },
            other => other.map(str::to_string),
        };
        let lease_id = match &command {
            Command::Renew { lease_id, .. } | Command::Release { lease_id, .. } => match lease_id.as_deref() {
                Some(id) if id != "-" => id.to_string(),
                _ => match secret_from_stdin("LEASE_ID", &mut stdin_used) {
                    Ok(id) => id,
                    Err(code) => return code,
                },
            },
            _ => String::new(),
        };
        let files = fencegate::client::TlsFiles {
            ca_file: conn.ca_file.clone(),
            client_cert_file: conn.client_cert.clone(),
            client_key_file: conn.client_key.clone(),
        };
        let c = match Client::with_tls(&conn.url, &files) {
            Ok(c) => match &token {
                Some(t) => c.with_bearer(t.clone()),
                None => c,
            },
            Err(e) => {
                eprintln!("fencegate: {e}");
                return ExitCode::from(cmd::EXIT_USAGE);
            }
        };
        let opts = |run: &RunArgs, command: &[String]| cmd::RunOpts {
            grace: run.grace,
            inject: run.inject,
            gateway_proxy: run.proxy.clone(),
            bearer: token.clone(),
            command: command.to_vec(),
        };
        match &command {
            Command::Acquire { key, ttl, wait, holder, .. } => cmd::acquire(&c, key, *ttl, *wait, holder).await,
            Command::Renew { key, ttl, .. } => cmd::renew(&c, key, &lease_id, *ttl).await,
            Command::Release { key, .. } => cmd::release(&c, key, &lease_id).await,
            Command::Status { key, .. } => cmd::status(&c, key).await,
            Command::Watch { key, after, timeout, .. } => cmd::watch(&c, key, *after, *timeout).await,
            Command::Lock { key, ttl, wait, holder, run, command, .. } => {
                cmd::lock(&c, key, *ttl, *wait, holder, opts(run, command)).await
            }
            Command::Elect { name, candidate, ttl, run, command, .. } => {
                cmd::elect(&c, name, candidate, *ttl, opts(run, command)).await
            }
            Command::Serve(_) | Command::CheckConfig { .. } | Command::HashToken { .. } | Command::Cluster(_) => {
                ExitCode::from(cmd::EXIT_USAGE)
            }
        }
    })
}

/// One line of stdin as a secret (`what` names it in errors); stdin can
/// give only one secret per command.
fn secret_from_stdin(what: &str, stdin_used: &mut bool) -> Result<String, ExitCode> {
    if std::mem::replace(stdin_used, true) {
        eprintln!("fencegate: {what}: stdin already gave another secret; pass one of them in the environment");
        return Err(ExitCode::from(cmd::EXIT_USAGE));
    }
    let mut line = String::new();
    match std::io::stdin().read_line(&mut line) {
        Ok(_) => {
            let secret = line.trim_end_matches(['\r', '\n']).to_string();
            if secret.is_empty() {
                eprintln!("fencegate: {what}: none given (argument, environment or one line of stdin)");
                return Err(ExitCode::from(cmd::EXIT_USAGE));
            }
            Ok(secret)
        }
        Err(e) => {
            eprintln!("fencegate: {what}: reading stdin: {e}");
            Err(ExitCode::from(cmd::EXIT_USAGE))
        }
    }
}

fn check_config(file: &std::path::Path) -> ExitCode {
    match Config::load(file).and_then(|c| fencegate::app::check(&c).map(|()| c).map_err(|e| e.to_string())) {
        Ok(c) => {
            for w in c.warnings() {
                eprintln!("{}: warning: {w}", file.display());
            }
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

/// Logs to stderr; access lines are buffered off the request path (see
/// `fencegate::logbuf`). Keep the guard until the gateway has stopped: its
/// drop writes out the lines still gathered.
fn init_tracing(cfg: &Config) -> fencegate::logbuf::LogGuard {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.log_level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only on a terminal: a log file or a collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (writer, guard) = fencegate::logbuf::start(Box::new(std::io::stderr()), fencegate::logbuf::Limits::default());
    if !ansi {
        // Access lines formatted without tracing's field machinery, in the
        // same format (a terminal gets tracing's coloured lines).
        fencegate::logbuf::install_access(&writer, cfg.log_format == "json");
    }
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer).with_ansi(ansi);
    if cfg.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
    guard
}

/// A data directory made before this version (or by hand) may be readable
/// by other local users; its files then leak lease ids. Said at start; the
/// modes are the operator's to change.
fn warn_if_data_dir_is_shared(dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(dir) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                data_dir = %dir.display(),
                mode = format!("{mode:03o}"),
                "the data directory is accessible to other users (group/world bits set); its files hold lease \
                 ids: chmod -R go-rwx it"
            );
        }
    }
}

fn serve(args: ServeArgs) -> ExitCode {
    // Everything this process creates is its own: the data directory 0700,
    // RocksDB's files (its write-ahead log holds live lease ids, the bearer
    // secrets of renew and release) and the object store's files 0600.
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    // No transparent huge pages for this process: with them the kernel
    // backs the allocator's arenas with 2 MiB pages, and the 512 KiB read
    // buffers of large bodies touching a few of them doubled the gateway's
    // peak RSS in 64 MiB uploads to an S3 route (60.6 / 66.6 MiB, against
    // 31.1 / 31.2 without, over the 64 MiB target; benches/s3/run.sh, the
    // same binary) for no throughput. Best effort: a kernel without this
    // prctl keeps them, and nothing else depends on it.
    let _ = rustix::thread::disable_transparent_huge_pages(true);
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
        log_format: args.log_format,
        etcd: args.etcd,
    });
    if let Err(e) = fencegate::app::check(&cfg) {
        eprintln!("fencegate: invalid configuration: {e}");
        return ExitCode::from(2);
    }
    // Dropped last (after the runtime), writing out the access lines of
    // the drained requests.
    let _log_guard = init_tracing(&cfg);
    for w in cfg.warnings() {
        tracing::warn!("configuration: {w}");
    }
    warn_if_data_dir_is_shared(&cfg.data_dir);
    // One worker per CPU this process may run on. With a single CPU (a
    // container limit, or `taskset`), the current-thread scheduler does the
    // same work without the work-stealing machinery.
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let built = if cpus == 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().enable_all().build()
    };
    let runtime = match built {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fencegate: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        // Installed before the start: a SIGTERM while the store opens stops
        // the gateway cleanly as soon as it is up.
        let stop_signal = fencegate::shutdown::os_signal();
        let gateway = match Gateway::start(cfg).await {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(error = %e, "fencegate could not start");
                return ExitCode::FAILURE;
            }
        };
        stop_signal.await;
        tracing::info!("shutdown signal received; draining");
        gateway.shutdown();
        gateway.wait().await;
        tracing::info!("fencegate stopped");
        ExitCode::SUCCESS
    })
}
