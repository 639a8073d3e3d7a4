//! The client commands of the `fencegate` binary: one-shot `acquire`,
//! `renew`, `release`, `status`, `watch` printing JSON, and `lock` / `elect`
//! that run a command while holding a lock.
//!
//! Exit codes (documented in the README):
//! 0 ok · 2 bad usage or request · 3 locked · 4 lease lost · 5 not owner ·
//! 6 gateway unreachable · 7 the lock was lost while the command ran (the
//! command was stopped) · otherwise, for `lock` and `elect`, the command's
//! own exit status (128 + N when it died of signal N).

use std::process::ExitCode;
use std::time::Duration;

use fencegate::client::{Client, ClientError, Lease};
use serde::Serialize;

pub const EXIT_USAGE: u8 = 2;
pub const EXIT_LOCKED: u8 = 3;
pub const EXIT_LOST: u8 = 4;
pub const EXIT_NOT_OWNER: u8 = 5;
pub const EXIT_UNREACHABLE: u8 = 6;
pub const EXIT_LOCK_LOST_DURING_COMMAND: u8 = 7;

/// Parses `500ms`, `30s`, `2m`, `1h`; a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{text:?} is not a duration (e.g. 500ms, 30s, 2m)"))?;
    let ms = match unit {
        "ms" => Some(n),
        "" | "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => return Err(format!("{text:?}: unit must be ms, s, m or h")),
    };
    ms.map(Duration::from_millis).ok_or_else(|| format!("{text:?} is too long"))
}

fn code_of(e: &ClientError) -> u8 {
    match e {
        ClientError::Locked { .. } => EXIT_LOCKED,
        ClientError::LeaseLost => EXIT_LOST,
        ClientError::NotOwner => EXIT_NOT_OWNER,
        ClientError::Unreachable(_) => EXIT_UNREACHABLE,
        ClientError::Api { .. } => EXIT_USAGE,
    }
}

fn fail(e: &ClientError) -> ExitCode {
    let (code, extra) = match e {
        ClientError::Locked { retry_after_ms } => ("locked", serde_json::json!({"retry_after_ms": retry_after_ms})),
        ClientError::LeaseLost => ("lease_lost", serde_json::json!({})),
        ClientError::NotOwner => ("not_owner", serde_json::json!({})),
        ClientError::Unreachable(_) => ("unreachable", serde_json::json!({})),
        ClientError::Api { code, .. } => (code.as_str(), serde_json::json!({})),
    };
    let mut body = serde_json::json!({"error": code, "message": e.to_string()});
    if let (Some(b), Some(x)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(x.clone());
    }
    eprintln!("{body}");
    ExitCode::from(code_of(e))
}

fn print<T: Serialize>(v: &T) -> ExitCode {
    match serde_json::to_string(v) {
        Ok(s) => {
            println!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fencegate: {e}");
            ExitCode::FAILURE
        }
    }
}

pub async fn acquire(client: &Client, key: &str, ttl: Duration, wait: Duration, holder: &str) -> ExitCode {
    match client.acquire_once(key, ttl, wait, holder).await {
        Ok(g) => print(&g),
        Err(e) => fail(&e),
    }
}

pub async fn renew(client: &Client, key: &str, lease_id: &str, ttl: Option<Duration>) -> ExitCode {
    match client.renew(key, lease_id, ttl).await {
        Ok(v) => print(&v),
        Err(e) => fail(&e),
    }
}

pub async fn release(client: &Client, key: &str, lease_id: &str) -> ExitCode {
    match client.release(key, lease_id).await {
        Ok(()) => print(&serde_json::json!({"key": key, "released": true})),
        Err(e) => fail(&e),
    }
}

pub async fn status(client: &Client, key: &str) -> ExitCode {
    match client.status(key).await {
        Ok(v) => print(&v),
        Err(e) => fail(&e),
    }
}

pub async fn watch(client: &Client, key: &str, after: u64, timeout: Duration) -> ExitCode {
    match client.watch(key, after, timeout).await {
        Ok(v) => print(&v),
        Err(e) => fail(&e),
    }
}

/// How `lock` and `elect` run their command.
pub struct RunOpts {
    pub grace: Duration,
    pub inject: bool,
    pub gateway_proxy: String,
    pub bearer: Option<String>,
    pub command: Vec<String>,
}

/// `fencegate lock KEY -- CMD`: acquire, run, renew, stop CMD on loss.
pub async fn lock(client: &Client, key: &str, ttl: Duration, wait: Duration, holder: &str, opts: RunOpts) -> ExitCode {
    let lease = match client.acquire_as(key, ttl, wait, holder).await {
        Ok(l) => l,
        Err(e) => return fail(&e),
    };
    run_while_held(client, lease, opts).await
}

/// `fencegate elect NAME --candidate ID -- CMD`: wait to lead, then run.
pub async fn elect(client: &Client, name: &str, candidate: &str, ttl: Duration, opts: RunOpts) -> ExitCode {
    eprintln!("{}", serde_json::json!({"event": "campaigning", "election": name, "candidate": candidate}));
    let leadership = loop {
        match client.acquire_as(name, ttl, Duration::from_secs(60), candidate).await {
            Ok(l) => break l,
            Err(ClientError::Locked { .. }) => continue,
            Err(ClientError::Unreachable(e)) => {
                eprintln!("{}", serde_json::json!({"event": "unreachable", "message": e}));
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return fail(&e),
        }
    };
    eprintln!("{}", serde_json::json!({"event": "elected", "election": name, "term": leadership.token()}));
    run_while_held(client, leadership, opts).await
}

async fn run_while_held(client: &Client, lease: Lease, opts: RunOpts) -> ExitCode {
    let Some((program, args)) = opts.command.split_first() else {
        eprintln!("fencegate: no command given after --");
        return ExitCode::from(EXIT_USAGE);
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .env("FENCING_TOKEN", lease.token().to_string())
        .env("FENCEGATE_KEY", lease.key())
        .env("FENCEGATE_URL", client.url())
        // The principal's bearer token and any lease id are this process's
        // secrets: the command gets its fencing token, not the credentials
        // that could acquire, renew or release in the principal's name.
        .env_remove("FENCEGATE_TOKEN")
        .env_remove("FENCEGATE_LEASE_ID");
    let _injector = if opts.inject {
        match fencegate::inject::start(&opts.gateway_proxy, lease.token(), opts.bearer.as_deref()).await {
            Ok(inj) => {
                // The injector's URL carries its per-run secret: only this
                // command can use it. An SDK's endpoint is the gateway
                // itself, reached through HTTP_PROXY.
                let url = inj.proxy_url();
                for var in ["HTTP_PROXY", "http_proxy", "FENCEGATE_PROXY_URL"] {
                    cmd.env(var, &url);
                }
                cmd.env("AWS_ENDPOINT_URL", &opts.gateway_proxy);
                // So that requests to the gateway (often on loopback, which
                // NO_PROXY lists tend to name) go through the injector.
                for var in ["NO_PROXY", "no_proxy"] {
                    cmd.env_remove(var);
                }
                Some(inj)
            }
            Err(e) => {
                eprintln!("fencegate: starting the injector: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fencegate: starting {program:?}: {e}");
            let _ = lease.release().await;
            return ExitCode::from(127);
        }
    };
    tokio::select! {
        status = child.wait() => {
            let _ = lease.release().await;
            match status {
                Ok(s) => exit_of(s),
                Err(e) => {
                    eprintln!("fencegate: waiting for {program:?}: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        () = lease.lost() => {
            eprintln!("{}", serde_json::json!({"event": "lock_lost", "key": lease.key(), "token": lease.token()}));
            stop_child(&mut child, opts.grace).await;
            ExitCode::from(EXIT_LOCK_LOST_DURING_COMMAND)
        }
        () = fencegate::shutdown::os_signal() => {
            stop_child(&mut child, opts.grace).await;
            let _ = lease.release().await;
            ExitCode::from(143)
        }
    }
}

/// SIGTERM, then SIGKILL after `grace`.
async fn stop_child(child: &mut tokio::process::Child, grace: Duration) {
    if let Some(pid) = child.id().and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
}

fn exit_of(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let signal = status.signal().unwrap_or(0);
    ExitCode::from(u8::try_from(128 + signal).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        for bad in ["", "x", "5d", "-1s", "1.5s", "99999999999999999999h"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
