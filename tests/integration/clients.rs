//! The Rust client and the command line against the real binary: one-shot
//! commands and their exit codes, `lock -- CMD` (environment, exit status,
//! child stopped on loss), `--inject` fencing an unmodified program,
//! election failover, and a `Lease` noticing loss.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Gateway, Opts};
use fencegate::client::Client;

fn fencegate(gw: &Gateway) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_fencegate"));
    c.env("FENCEGATE_URL", gw.api_url("")).env("FENCEGATE_PROXY", gw.proxy_url(""));
    c
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap()
}

fn start() -> (tempfile::TempDir, Gateway) {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts::default());
    (dir, gw)
}

#[test]
fn one_shot_commands_print_json_and_exit_codes() {
    let (_d, gw) = start();
    let out = run(fencegate(&gw).args(["acquire", "jobs/1", "--ttl", "30s", "--holder", "cli"]));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let grant: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(grant["fencing_token"], 1);
    let lease_id = grant["lease_id"].as_str().unwrap().to_string();

    let out = run(fencegate(&gw).args(["acquire", "jobs/1", "--ttl", "5s"]));
    assert_eq!(out.status.code(), Some(3), "locked");
    let err: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(err["error"], "locked");

    let out = run(fencegate(&gw).args(["renew", "jobs/1", &lease_id, "--ttl", "1m"]));
    assert_eq!(out.status.code(), Some(0));
    let out = run(fencegate(&gw).args(["renew", "jobs/1", "nope"]));
    assert_eq!(out.status.code(), Some(4), "lease lost");
    let out = run(fencegate(&gw).args(["release", "jobs/1", "nope"]));
    assert_eq!(out.status.code(), Some(5), "not owner");
    let out = run(fencegate(&gw).args(["status", "jobs/1"]));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["holder"], "cli");
    assert!(status.get("lease_id").is_none());
    let out = run(fencegate(&gw).args(["watch", "jobs/1", "--after", "1", "--timeout", "200ms"]));
    assert_eq!(out.status.code(), Some(0));
    let out = run(fencegate(&gw).args(["release", "jobs/1", &lease_id]));
    assert_eq!(out.status.code(), Some(0));
    let out = run(fencegate(&gw).args(["acquire", "jobs/1", "--ttl", "banana"]));
    assert_eq!(out.status.code(), Some(2), "bad duration is a usage error");
    let port = common::free_port();
    let out = run(fencegate(&gw).args(["status", "k", "--url", &format!("http://127.0.0.1:{port}")]));
    assert_eq!(out.status.code(), Some(6), "unreachable");
}

#[test]
fn lock_runs_the_command_with_its_token_and_propagates_its_status() {
    let (_d, gw) = start();
    let out = run(fencegate(&gw).args([
        "lock",
        "jobs/env",
        "--ttl",
        "5s",
        "--",
        "sh",
        "-c",
        "echo $FENCING_TOKEN $FENCEGATE_KEY $FENCEGATE_URL; exit 42",
    ]));
    assert_eq!(out.status.code(), Some(42));
    let line = String::from_utf8_lossy(&out.stdout);
    assert_eq!(line.trim(), format!("1 jobs/env {}", gw.api_url("")));
    // Released when the command exited: the next token is 2, at once.
    let out = run(fencegate(&gw).args(["lock", "jobs/env", "--wait", "0s", "--", "sh", "-c", "echo $FENCING_TOKEN"]));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "2");
}

#[test]
fn lock_stops_the_command_when_the_lease_is_lost() {
    let (_d, gw) = start();
    let started = Instant::now();
    let mut child = fencegate(&gw)
        .args(["lock", "jobs/long", "--ttl", "1s", "--grace", "1s", "--", "sleep", "30"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // The gateway freezes: renewals go unanswered; the local deadline passes.
    common::signal(gw.child.id(), "STOP");
    let status = child.wait().unwrap();
    common::signal(gw.child.id(), "CONT");
    assert_eq!(status.code(), Some(7), "documented code for a lost lock");
    assert!(started.elapsed() < Duration::from_secs(5), "the command must be stopped promptly, not after 30 s");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("lock_lost"), "{err}");
}

#[test]
fn inject_fences_an_unmodified_program() {
    let (_d, gw) = start();
    let target = gw.proxy_url("/ledger/legacy");
    let upload = format!(
        "import urllib.request as u; r = u.urlopen(u.Request('{target}', data=b'from python', method='PUT')); print(r.status)"
    );
    // Without --inject the plain program carries no token: refused (428).
    let out = run(fencegate(&gw).args(["lock", "ledger/legacy", "--", "python3", "-c", &upload]));
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("428"), "{}", String::from_utf8_lossy(&out.stderr));
    // With --inject the same program is fenced with the lock's token.
    let out = run(fencegate(&gw).args(["lock", "ledger/legacy", "--inject", "--", "python3", "-c", &upload]));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).trim().starts_with("20"));
    // curl, unmodified, the same way.
    if Command::new("curl").arg("--version").output().is_ok() {
        let out = run(fencegate(&gw).args([
            "lock",
            "ledger/legacy",
            "--inject",
            "--",
            "curl",
            "-sf",
            "-X",
            "PUT",
            "--data",
            "from curl",
            &target,
        ]));
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    } else {
        panic!("curl is not installed: scripts/setup-system.sh test installs it");
    }
    let data = gw.data_dir.join("objects/ledger/legacy");
    assert_eq!(std::fs::read(&data).unwrap(), b"from curl");
}

#[test]
fn elect_fails_over_within_one_ttl_plus_a_renew_period() {
    let (dir, gw) = start();
    let spawn = |candidate: &str| {
        let marker = dir.path().join(format!("{candidate}.pid"));
        let script = format!("echo $$ > {}; exec sleep 60", marker.display());
        let child = fencegate(&gw)
            .args(["elect", "leader/x", "--candidate", candidate, "--ttl", "1s", "--", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        (child, marker)
    };
    let (mut first, first_marker) = spawn("c1");
    let wait_for = |p: &std::path::Path| {
        let t = Instant::now();
        while !p.exists() {
            assert!(t.elapsed() < Duration::from_secs(10), "{} never started", p.display());
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    wait_for(&first_marker);
    let (mut second, second_marker) = spawn("c2");
    let (mut third, third_marker) = spawn("c3");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!second_marker.exists() && !third_marker.exists(), "only one leader at a time");
    // The leader dies with its command.
    let leader_cmd: u32 = std::fs::read_to_string(&first_marker).unwrap().trim().parse().unwrap();
    let died = Instant::now();
    first.kill().unwrap();
    let _ = first.wait();
    common::signal(leader_cmd, "KILL");
    let t = Instant::now();
    while !second_marker.exists() && !third_marker.exists() {
        assert!(t.elapsed() < Duration::from_secs(5), "no standby took over");
        std::thread::sleep(Duration::from_millis(5));
    }
    let failover = died.elapsed();
    println!("failover in {} ms", failover.as_millis());
    assert!(failover < Duration::from_millis(1000 + 333 + 200), "failover took {failover:?}");
    assert!(!(second_marker.exists() && third_marker.exists()), "two leaders");
    for c in [&mut second, &mut third] {
        let _ = c.kill();
        let _ = c.wait();
    }
    for m in [&second_marker, &third_marker] {
        if let Ok(pid) = std::fs::read_to_string(m) {
            common::signal(pid.trim().parse().unwrap(), "KILL");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn lease_renews_itself_and_notices_a_refused_renewal() {
    let (_d, gw) = start();
    let client = Client::new(&gw.api_url("")).unwrap();
    let lease = client.acquire("k", Duration::from_millis(600), Duration::ZERO).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!lease.is_lost(), "renewals every ttl/3 keep it");
    assert!(client.status("k").await.unwrap().held);
    // Someone with the secret releases it: the next renewal is refused.
    client.release("k", lease.lease_id()).await.unwrap();
    let t = Instant::now();
    tokio::time::timeout(Duration::from_secs(2), lease.lost()).await.unwrap();
    assert!(t.elapsed() < Duration::from_millis(600));
    assert!(matches!(client.acquire("k", Duration::from_secs(1), Duration::ZERO).await.map(|l| l.token()), Ok(2)));
}

#[tokio::test(flavor = "multi_thread")]
async fn lease_is_lost_by_its_local_deadline_when_the_gateway_freezes() {
    let (_d, gw) = start();
    let client = Client::new(&gw.api_url("")).unwrap();
    // The local deadline counts from before the acquire was sent.
    let before_acquire = Instant::now();
    let lease = client.acquire("k", Duration::from_millis(900), Duration::ZERO).await.unwrap();
    common::signal(gw.child.id(), "STOP");
    tokio::time::timeout(Duration::from_secs(3), lease.lost()).await.unwrap();
    let after = before_acquire.elapsed();
    common::signal(gw.child.id(), "CONT");
    // 900 ms plus what a loaded test machine adds to a timer's wake-up.
    assert!(
        after <= Duration::from_millis(900 + 100),
        "lost() must fire by the local deadline (900 ms after the acquire was sent): {after:?}"
    );
    assert!(after >= Duration::from_millis(900), "lost() fired before the deadline: {after:?}");
    // The gateway, thawed, still counts the grant live for a moment: the
    // client's view is the more pessimistic one, as it must be.
}

fn run_with_stdin(cmd: &mut Command, input: &str) -> Output {
    use std::io::Write;
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// Secrets stay off the command line: the lease id of `renew` and
/// `release` comes from FENCEGATE_LEASE_ID or stdin, the bearer token from
/// FENCEGATE_TOKEN or `--token -` (stdin); and the command `lock` runs
/// never inherits the principal's bearer token.
#[test]
fn secrets_come_from_the_environment_or_stdin_and_children_do_not_inherit_the_bearer() {
    let dir = tempfile::tempdir().unwrap();
    let principals = dir.path().join("principals.toml");
    let hash = fencegate::auth::hash_token("ops-secret");
    std::fs::write(
        &principals,
        format!("[[principals]]\nname = \"ops\"\ntoken_sha256 = \"{hash}\"\nprefixes = [\"\"]\n"),
    )
    .unwrap();
    let cfg = format!("[auth]\nprincipals_file = \"{}\"\n", principals.display());
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let authed = || {
        let mut c = fencegate(&gw);
        c.env("FENCEGATE_TOKEN", "ops-secret");
        c
    };
    let out = run(authed().args(["acquire", "jobs/1", "--ttl", "30s"]));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let grant: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let lease_id = grant["lease_id"].as_str().unwrap().to_string();

    // The lease id from the environment, from stdin (omitted, or `-`).
    let out = run(authed().args(["renew", "jobs/1"]).env("FENCEGATE_LEASE_ID", &lease_id));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run_with_stdin(authed().args(["renew", "jobs/1", "--ttl", "1m"]), &format!("{lease_id}\n"));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run_with_stdin(authed().args(["renew", "jobs/1", "-"]), "not-the-lease\n");
    assert_eq!(out.status.code(), Some(4), "a wrong id from stdin is a lost lease");
    // The bearer token from stdin: without it 401 (usage), with it ok.
    let out = run(fencegate(&gw).args(["status", "jobs/1"]));
    assert_eq!(out.status.code(), Some(2), "no credentials");
    let out = run_with_stdin(fencegate(&gw).args(["status", "jobs/1", "--token", "-"]), "ops-secret\n");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // Both from stdin cannot work: one line, one secret.
    let out = run_with_stdin(fencegate(&gw).args(["release", "jobs/1", "--token", "-"]), "ops-secret\n");
    assert_eq!(out.status.code(), Some(2));
    let out = run_with_stdin(authed().args(["release", "jobs/1"]), &format!("{lease_id}\n"));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));

    // The command run under the lock sees its fencing token, not the bearer.
    let out = run(authed().env("FENCEGATE_LEASE_ID", "x").args([
        "lock",
        "jobs/2",
        "--",
        "sh",
        "-c",
        "echo \"${FENCING_TOKEN} [${FENCEGATE_TOKEN-unset}] [${FENCEGATE_LEASE_ID-unset}]\"",
    ]));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout);
    let (token, rest) = line.trim().split_once(' ').unwrap();
    assert!(token.parse::<u64>().is_ok(), "{line}");
    assert_eq!(rest, "[unset] [unset]");

    // --help says where the secrets may come from.
    let help = run(fencegate(&gw).args(["renew", "--help"]));
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("FENCEGATE_LEASE_ID") && help.contains("stdin") && help.contains("--token -"), "{help}");
}

#[tokio::test(flavor = "multi_thread")]
async fn lease_debug_never_shows_the_lease_id() {
    let (_d, gw) = start();
    let client = Client::new(&gw.api_url("")).unwrap();
    let lease = client.acquire("k", Duration::from_secs(5), Duration::ZERO).await.unwrap();
    let shown = format!("{lease:?}");
    assert!(!shown.contains(lease.lease_id()), "{shown}");
    assert!(shown.contains("redacted") && shown.contains("\"k\""), "{shown}");
    lease.release().await.unwrap();
}

/// A third-party HTTP server that records every connection made to it.
struct ThirdParty {
    addr: std::net::SocketAddr,
    seen: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl ThirdParty {
    fn start() -> ThirdParty {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (s, c) = (seen.clone(), connections.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
                let mut buf = [0u8; 4096];
                if let Ok(n) = stream.read(&mut buf) {
                    s.lock().unwrap().extend_from_slice(&buf[..n]);
                }
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
            }
        });
        ThirdParty { addr, seen, connections }
    }

    fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// One request on a fresh connection; the status and the body.
fn raw_request(addr: &str, request: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

fn base64(input: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in input.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            out.push(if i <= chunk.len() { char::from(A[((n >> (18 - 6 * i)) & 63) as usize]) } else { '=' });
        }
    }
    out
}

/// The `--inject` proxy forwards only to the gateway's proxy listener (a
/// third party never sees the token or the principal's credentials; an
/// `https://` target is refused, not downgraded) and serves only the
/// command it was started for: a second local client without the per-run
/// secret gets 407 and cannot write with the holder's token.
#[test]
fn inject_forwards_only_to_the_gateway_and_only_for_its_command() {
    let (dir, gw) = start();
    let third = ThirdParty::start();
    let url_file = dir.path().join("proxy-url");
    let done = dir.path().join("done");
    let script = format!(
        "echo \"$HTTP_PROXY $FENCEGATE_PROXY_URL $AWS_ENDPOINT_URL\" > {}; \
         curl -s -o /dev/null -w '%{{http_code}}' -X PUT --data leak http://{}/x > {}.child; \
         while [ ! -e {} ]; do sleep 0.05; done",
        url_file.display(),
        third.addr,
        url_file.display(),
        done.display()
    );
    let mut lock = fencegate(&gw)
        .env("FENCEGATE_TOKEN", "holder-bearer")
        .args(["lock", "ledger/inj", "--inject", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let child_result = url_file.with_extension("child");
    let t = Instant::now();
    while std::fs::read_to_string(&child_result).map_or(true, |s| s.len() < 3) {
        assert!(t.elapsed() < Duration::from_secs(20), "the command never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The command's own call to a third party through HTTP_PROXY: 403.
    assert_eq!(std::fs::read_to_string(&child_result).unwrap(), "403");
    let vars = std::fs::read_to_string(&url_file).unwrap();
    let vars: Vec<&str> = vars.split_whitespace().collect();
    let (proxy_url, origin_url, endpoint) = (vars[0], vars[1], vars[2]);
    assert_eq!(proxy_url, origin_url);
    assert_eq!(endpoint, gw.proxy_url(""), "an SDK's endpoint is the gateway, reached through HTTP_PROXY");
    let (userinfo, injector) = proxy_url.strip_prefix("http://").unwrap().split_once('@').unwrap();
    let (user, secret) = userinfo.split_once(':').unwrap();
    assert!(secret.len() >= 32, "a per-run random secret: {secret}");
    let good = format!("Proxy-Authorization: Basic {}\r\n", base64(format!("{user}:{secret}").as_bytes()));
    let wrong = format!("Proxy-Authorization: Basic {}\r\n", base64(format!("{user}:not-{secret}").as_bytes()));
    let gw_addr = gw.proxy.to_string();
    let put = |target: &str, auth: &str| {
        format!("PUT {target} HTTP/1.1\r\nHost: {gw_addr}\r\n{auth}Content-Length: 5\r\nConnection: close\r\n\r\nstray")
    };
    let object = gw.data_dir.join("objects/ledger/inj");

    // A second local client without the secret: 407, nothing written.
    for (target, auth) in [
        (format!("http://{gw_addr}/ledger/inj"), String::new()),
        ("/ledger/inj".to_string(), String::new()),
        (format!("http://{gw_addr}/ledger/inj"), wrong.clone()),
    ] {
        let (status, body) = raw_request(injector, &put(&target, &auth));
        assert_eq!(status, 407, "{target} {auth:?}: {body}");
        assert!(body.contains("proxy_authentication_required"), "{body}");
    }
    assert!(!object.exists(), "a request without the secret must not be forwarded");

    // With the secret: any authority but the gateway's, and https, is 403.
    for target in [
        format!("http://{}/x", third.addr),
        format!("https://{}/x", third.addr),
        format!("https://{gw_addr}/ledger/inj"),
        format!("http://localhost:{}/ledger/inj", gw.proxy.port()),
    ] {
        let (status, body) = raw_request(injector, &put(&target, &good));
        assert_eq!(status, 403, "{target}: {body}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&body).unwrap()["error"], "forbidden");
        let get = format!("GET {target} HTTP/1.1\r\nHost: x\r\n{good}Connection: close\r\n\r\n");
        assert_eq!(raw_request(injector, &get).0, 403, "{target}");
    }
    assert_eq!(
        third.connections(),
        0,
        "the third party saw: {:?}",
        String::from_utf8_lossy(&third.seen.lock().unwrap())
    );
    assert!(!object.exists());

    // The command's own way in still works, fenced with the lock's token.
    let (status, body) = raw_request(injector, &put(&format!("http://{gw_addr}/ledger/inj"), &good));
    assert!((200..300).contains(&status), "{status} {body}");
    assert_eq!(std::fs::read(&object).unwrap(), b"stray");
    // Origin-form, the secret as a base URL's credentials (curl sends the
    // userinfo of FENCEGATE_PROXY_URL as Authorization: Basic).
    let base = good.replace("Proxy-Authorization", "Authorization");
    let (status, body) = raw_request(injector, &put("/ledger/inj", &base).replace("stray", "based"));
    assert!((200..300).contains(&status), "{status} {body}");
    assert_eq!(std::fs::read(&object).unwrap(), b"based");

    std::fs::write(&done, b"").unwrap();
    let status = lock.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}

/// `Lease::sequenced` numbers a lease's writes: sent in order they pass; a
/// write replayed with an earlier number after a later one was forwarded is
/// refused with 409 `stale_sequence`.
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_numbers_its_writes_and_a_replayed_one_is_refused() {
    let (_d, gw) = start();
    let client = Client::new(&gw.api_url("")).unwrap();
    let lease = client.acquire("ledger/seq", Duration::from_secs(30), Duration::ZERO).await.unwrap();
    let http = common::Http::default();
    let url = gw.proxy_url("/ledger/seq");
    let mut sent = Vec::new();
    for body in ["one", "two"] {
        let headers = lease.sequenced();
        let values: Vec<(String, String)> =
            headers.iter().map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string())).collect();
        let pairs: Vec<(&str, &str)> = values.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert!(http.send(http::Method::PUT, &url, &pairs, body).await.status.is_success());
        sent.push(values);
    }
    assert_eq!(sent[0][1], ("x-fencing-sequence".to_string(), "1".to_string()));
    let replay: Vec<(&str, &str)> = sent[0].iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    let r = http.send(http::Method::PUT, &url, &replay, "one, late").await;
    assert_eq!(r.status, http::StatusCode::CONFLICT);
    assert_eq!(r.error_code(), "stale_sequence");
    assert_eq!(http.get(&url).await.body.as_ref(), b"two");
    lease.release().await.unwrap();
}
