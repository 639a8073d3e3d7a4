//! Runs the example against a real s3s-fs (it verifies SigV4, so the
//! signed `X-Fencing-Token` must reach it untouched) behind a real gateway
//! with an S3 route, and checks what the SDK saw: A's live write
//! forwarded, B's write forwarded, A's stale write refused with the S3 XML
//! error readable in the SDK error (`StaleFencingToken`, 409), the object
//! B's.
//!
//! Needs `FENCEGATE_BIN` (the gateway binary) and s3s-fs (`S3S_FS`, or
//! `~/.cargo/bin/s3s-fs` as `scripts/setup-s3.sh` installs it); a missing
//! one fails the test, it is never skipped.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const AK: &str = "fencegate-example-ak";
const SK: &str = "fencegate-example-secret-key";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A child process killed (by its PID) when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn s3s_fs() -> PathBuf {
    if let Ok(p) = std::env::var("S3S_FS") {
        return PathBuf::from(p);
    }
    let home = std::env::var("CARGO_HOME")
        .map_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap()).join(".cargo"), PathBuf::from);
    home.join("bin/s3s-fs")
}

/// Waits until `GET path` on `port` answers 200.
fn wait_ready(port: u16, path: &str, what: &str, child: &mut Child) {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(20) {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what} exited with {status} before it was ready");
        }
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
            let mut answer = String::new();
            if s.write_all(req.as_bytes()).is_ok()
                && s.read_to_string(&mut answer).is_ok()
                && answer.starts_with("HTTP/1.1 200")
            {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} did not become ready on port {port}");
}

#[test]
fn stale_sdk_write_is_refused_with_the_s3_error_in_the_sdk_error() {
    let gateway =
        std::env::var("FENCEGATE_BIN").expect("set FENCEGATE_BIN to the gateway binary (e.g. target/debug/fencegate)");
    let dir = tempfile::tempdir().unwrap();
    let s3_dir = dir.path().join("s3");
    std::fs::create_dir_all(&s3_dir).unwrap();

    let s3_port = free_port();
    let mut s3 = Command::new(s3s_fs())
        .args(["--host", "127.0.0.1", "--port", &s3_port.to_string(), "--access-key", AK, "--secret-key", SK])
        .arg(&s3_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("s3s-fs could not be started ({e}): run scripts/setup-s3.sh"));
    let started = Instant::now();
    while TcpStream::connect(("127.0.0.1", s3_port)).is_err() {
        assert!(started.elapsed() < Duration::from_secs(10), "s3s-fs did not come up");
        assert!(s3.try_wait().unwrap().is_none(), "s3s-fs exited at start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _s3 = Running(s3);

    let (proxy, api) = (free_port(), free_port());
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = {data:?}\nlisten = \"127.0.0.1:{proxy}\"\napi_listen = \"127.0.0.1:{api}\"\n\n\
             [[routes]]\nname = \"s3\"\nkind = \"s3\"\nupstream = \"http://127.0.0.1:{s3_port}\"\n",
            data = dir.path().join("data").to_str().unwrap(),
        ),
    )
    .unwrap();
    let mut gw = Command::new(&gateway)
        .args(["serve", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{gateway} could not be started: {e}"));
    wait_ready(api, "/readyz", "the gateway", &mut gw);
    let _gw = Running(gw);

    let out = Command::new(env!("CARGO_BIN_EXE_fencegate-example-aws-sdk-s3"))
        .env("FENCEGATE_URL", format!("http://127.0.0.1:{api}"))
        .env("S3_ENDPOINT", format!("http://127.0.0.1:{proxy}"))
        .env("AWS_ACCESS_KEY_ID", AK)
        .env("AWS_SECRET_ACCESS_KEY", SK)
        .env("S3_BUCKET", "sdk-example")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}{stderr}");
    assert!(out.status.success(), "the example failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("(customize().mutate_request) -> ok"), "{stdout}");
    assert!(stdout.contains("PutObject -> HTTP 409 StaleFencingToken ("), "{stdout}");
    assert!(stdout.contains("the object holds: \"B's final report\""), "{stdout}");
    // What s3s-fs wrote: B's bytes, never A's stale ones.
    let stored = std::fs::read(s3_dir.join("sdk-example/report.txt")).unwrap();
    assert_eq!(stored, b"B's final report");
}
