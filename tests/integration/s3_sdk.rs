//! Real S3 clients through an S3 route to real S3 servers: s3s-fs (it
//! verifies SigV4 header signatures, presigned URLs and chunk signatures)
//! with boto3 and the AWS CLI, and moto's server (PostObject,
//! DeleteObjects). Both are installed by `scripts/setup-s3.sh`,
//! which these tests run when something is missing; a component that still
//! cannot be found fails the test loudly, it is never skipped.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, Gateway, Opts};

const AK: &str = "fencegate-test-ak";
const SK: &str = "fencegate-test-secret-key";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `scripts/setup-s3.sh` once per test binary (it is idempotent and
/// takes a lock, so concurrent binaries wait for one another).
fn setup() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let out = Command::new("bash").arg(repo().join("scripts/setup-s3.sh")).output().unwrap();
        assert!(
            out.status.success(),
            "scripts/setup-s3.sh failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    });
}

fn s3s_fs_bin() -> PathBuf {
    if let Ok(p) = std::env::var("S3S_FS") {
        return PathBuf::from(p);
    }
    let home = std::env::var("CARGO_HOME")
        .map_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap()).join(".cargo"), PathBuf::from);
    let installed = home.join("bin/s3s-fs");
    if installed.exists() {
        return installed;
    }
    PathBuf::from("s3s-fs")
}

/// A running s3s-fs, stopped (by its PID) when dropped.
pub struct S3Server {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl S3Server {
    pub fn start() -> S3Server {
        setup();
        let dir = tempfile::tempdir().unwrap();
        for _ in 0..5 {
            let port = free_port();
            let mut child = Command::new(s3s_fs_bin())
                .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--access-key", AK, "--secret-key", SK])
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("s3s-fs could not be started ({e}): run scripts/setup-s3.sh"));
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(10) {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return S3Server { child, port, _dir: dir };
                }
                if let Ok(Some(_)) = child.try_wait() {
                    break; // the port was taken: try another
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("s3s-fs did not come up");
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn gateway_in_front_of(s3: &S3Server, dir: &Path) -> Gateway {
    let config = format!("[[routes]]\nname = \"s3\"\nkind = \"s3\"\nupstream = \"{}\"\n", s3.url());
    Gateway::start(&dir.join("data"), Opts { config: Some(config), ..Opts::default() })
}

fn python() -> PathBuf {
    repo().join(".venv/bin/python")
}

#[test]
fn boto3_against_s3s_fs_every_mutation_kind_live_stale_and_readable() {
    let s3 = S3Server::start();
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway_in_front_of(&s3, dir.path());
    let out = Command::new(python())
        .arg(repo().join("tests/python/s3_sdk.py"))
        .env("FG_PROXY", gw.proxy_url(""))
        .env("FG_API", gw.api_url(""))
        .env("S3_DIRECT", s3.url())
        .env("S3_AK", AK)
        .env("S3_SK", SK)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}\n--- gateway log ---\n{}", gw.log_text());
    assert!(text.contains("ok: "), "{text}");
    println!("{text}");
}

#[test]
fn aws_cli_shows_the_refusal_and_its_code() {
    let s3 = S3Server::start();
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway_in_front_of(&s3, dir.path());
    let aws = |args: &[&str]| {
        let file = dir.path().join("upload.txt");
        std::fs::write(&file, "from the cli").unwrap();
        Command::new(repo().join(".venv/bin/aws"))
            .args(["--endpoint-url", &gw.proxy_url(""), "--region", "us-east-1"])
            .args(args.iter().map(|a| a.replace("{file}", file.to_str().unwrap())))
            .env("AWS_ACCESS_KEY_ID", AK)
            .env("AWS_SECRET_ACCESS_KEY", SK)
            .env("AWS_CONFIG_FILE", "/dev/null")
            .env("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
            .output()
            .unwrap()
    };
    // The CLI adds no fencing header: its writes are refused, and the
    // refusal's code is in what it prints.
    let out = aws(&["s3api", "put-object", "--bucket", "cli", "--key", "k", "--body", "{file}"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("FencingTokenRequired"), "{err}");
    let out = aws(&["s3", "cp", "{file}", "s3://cli/k"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("FencingTokenRequired"), "{err}");
    // Reads need no token.
    let out = aws(&["s3api", "list-buckets"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn s3_gc_pause_example_leaves_the_object_to_the_new_holder() {
    setup();
    let out = Command::new(python())
        .arg(repo().join("examples/python/s3_gc_pause.py"))
        .env("FENCEGATE_BIN", env!("CARGO_BIN_EXE_fencegate"))
        .env("S3S_FS", s3s_fs_bin())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("part 2 -> HTTP 409 StaleFencingToken"), "{stdout}");
    assert!(stdout.contains("CompleteMultipartUpload -> HTTP 409 StaleFencingToken"), "{stdout}");
    assert!(stdout.contains("the object holds: \"B's complete video\""), "{stdout}");
}

fn run_handover(extra: &str, expect_anomaly: bool) -> String {
    let s3 = S3Server::start();
    let dir = tempfile::tempdir().unwrap();
    let config = format!("[[routes]]\nname = \"s3\"\nkind = \"s3\"\nupstream = \"{}\"\n{extra}\n", s3.url());
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(config), ..Opts::default() });
    let mut cmd = Command::new(python());
    cmd.arg(repo().join("tests/python/s3_handover.py"));
    if expect_anomaly {
        cmd.arg("--expect-anomaly");
    }
    let out = cmd
        .env("FG_PROXY", gw.proxy_url(""))
        .env("FG_API", gw.api_url(""))
        .env("S3_DIRECT", s3.url())
        .env("S3_AK", AK)
        .env("S3_SK", SK)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    text
}

#[test]
fn handovers_with_zombies_on_s3_leave_every_object_to_its_newest_holder() {
    let text = run_handover("", false);
    assert!(text.contains(" 0 anomalies"), "{text}");
    println!("{text}");
}

#[test]
fn the_handover_checker_catches_an_unfenced_s3_route() {
    // Shadow mode forwards what it would refuse: the zombies' writes land.
    let text = run_handover("enforce = false", true);
    assert!(!text.contains(" 0 anomalies"), "{text}");
    println!("{text}");
}

/// moto's S3 server (PyPI, in the venv), stopped by its PID when dropped.
struct Moto {
    child: Child,
    port: u16,
}

impl Moto {
    fn start() -> Moto {
        setup();
        for _ in 0..5 {
            let port = free_port();
            let mut child = Command::new(repo().join(".venv/bin/moto_server"))
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                // Path style only, as docs/s3.md says to run moto.
                .env("S3_IGNORE_SUBDOMAIN_BUCKETNAME", "true")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("moto_server could not be started ({e}): run scripts/setup-s3.sh"));
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(30) {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Moto { child, port };
                }
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("moto_server did not come up");
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn post_object_and_delete_objects_against_moto() {
    let moto = Moto::start();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("http://127.0.0.1:{}", moto.port);
    let config = format!("[[routes]]\nname = \"s3\"\nkind = \"s3\"\nupstream = \"{url}\"\n");
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(config), ..Opts::default() });
    let out = Command::new(python())
        .arg(repo().join("tests/python/s3_moto.py"))
        .env("FG_PROXY", gw.proxy_url(""))
        .env("FG_API", gw.api_url(""))
        .env("S3_DIRECT", &url)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}\n--- gateway log ---\n{}", gw.log_text());
    assert!(text.contains("ok: PostObject and DeleteObjects against moto"), "{text}");
}
