//! The command line: `check-config` and `serve` with no arguments.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

fn fencegate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fencegate"))
}

#[test]
fn example_config_is_valid() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/fencegate.example.toml");
    let out = fencegate().arg("check-config").arg(path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok (2 route(s)"));
}

#[test]
fn check_config_names_the_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[locks]\nmax_ttl = 5\n", "max_ttl"),
        ("listen = \"nope\"\n", "listen"),
        (
            "[[routes]]\nmatch = \"/{id}\"\nresource = \"{x}\"\nupstream = \"http://127.0.0.1:1\"\n",
            "routes[0].resource",
        ),
        ("[[routes]]\nmatch = \"/{*p}\"\nupstream = \"gopher://x\"\n", "routes[0].upstream"),
        ("[locks]\nmin_ttl_ms = 10\nmax_ttl_ms = 1\n", "locks.max_ttl_ms"),
    ];
    for (text, key) in cases {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, text).unwrap();
        let out = fencegate().arg("check-config").arg(&path).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key), "{text}: {err}");
    }
}

/// One `GET` over a fresh connection; true when the status line says 200.
fn answers_200(addr: &str, path: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

#[test]
fn serve_with_no_arguments_runs_on_the_embedded_defaults() {
    let dir = tempfile::tempdir().unwrap();
    for port in [8080, 7070] {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "port {port} is taken; this test needs the default ports free"
        );
    }
    let mut child = fencegate().arg("serve").current_dir(dir.path()).spawn().unwrap();
    // The ports accept before the store is open (bound first; connections
    // wait in the backlog), so readiness is an answer from /readyz.
    let started = Instant::now();
    while !answers_200("127.0.0.1:7070", "/readyz") || std::net::TcpStream::connect("127.0.0.1:8080").is_err() {
        assert!(started.elapsed() < Duration::from_secs(30), "defaults did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(dir.path().join("fencegate-data/db").is_dir());
    assert!(dir.path().join("fencegate-data/objects").is_dir());
    common::signal(child.id(), "TERM");
    assert!(child.wait().unwrap().success());
}

/// A principals file with nobody in it would leave authentication off
/// without a word: `check-config` and `serve` both refuse it. A prefix that
/// does not end in `/` is refused too, naming the principal.
#[test]
fn empty_principals_and_partial_prefixes_are_configuration_errors() {
    let dir = tempfile::tempdir().unwrap();
    let principals = dir.path().join("principals.toml");
    let config = dir.path().join("fencegate.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = \"{}\"\nlisten = \"127.0.0.1:0\"\napi_listen = \"127.0.0.1:0\"\n[auth]\nprincipals_file = \"{}\"\napi = true\n",
            dir.path().join("data").display(),
            principals.display()
        ),
    )
    .unwrap();
    let hash = fencegate::auth::hash_token("t");
    let cases = [
        ("principals = []\n".to_string(), "empty"),
        (
            format!("[[principals]]\nname = \"billing\"\ntoken_sha256 = \"{hash}\"\nprefixes = [\"invoices\"]\n"),
            "billing",
        ),
    ];
    for (text, needle) in cases {
        std::fs::write(&principals, &text).unwrap();
        let out = fencegate().arg("check-config").arg(&config).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("principals_file") && err.contains(needle), "{text}: {err}");
        let out = fencegate().args(["serve", "--config"]).arg(&config).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "serve must refuse it too: {text}");
        assert!(!dir.path().join("data").exists(), "refused before anything was created");
    }
}

#[test]
fn check_config_warns_about_an_open_route_over_auth_keys() {
    let dir = tempfile::tempdir().unwrap();
    let principals = dir.path().join("principals.toml");
    let hash = fencegate::auth::hash_token("t");
    std::fs::write(
        &principals,
        format!("[[principals]]\nname = \"billing\"\ntoken_sha256 = \"{hash}\"\nprefixes = [\"invoices/\"]\n"),
    )
    .unwrap();
    let config = dir.path().join("fencegate.toml");
    let routes = "[[routes]]\nname = \"invoices\"\nmatch = \"/invoices/{*rest}\"\nupstream = \"http://127.0.0.1:9\"\nauth = true\n";
    let open = "[[routes]]\nname = \"rest\"\nmatch = \"/{*path}\"\nupstream = \"http://127.0.0.1:9\"\n";
    let head = format!("[auth]\nprincipals_file = \"{}\"\n", principals.display());
    std::fs::write(&config, format!("{head}{routes}{open}")).unwrap();
    let out = fencegate().arg("check-config").arg(&config).output().unwrap();
    assert!(out.status.success(), "a warning, not an error: {}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("warning") && err.contains("routes[1] (rest)") && err.contains("routes[0]"), "{err}");
    // Without the open catch-all: no warning.
    std::fs::write(&config, format!("{head}{routes}")).unwrap();
    let out = fencegate().arg("check-config").arg(&config).output().unwrap();
    assert!(out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("warning"));
}

/// Every file and directory under `dir` (and `dir` itself): its mode bits.
fn modes_under(dir: &std::path::Path, out: &mut Vec<(std::path::PathBuf, u32)>) {
    use std::os::unix::fs::PermissionsExt;
    out.push((dir.to_path_buf(), std::fs::metadata(dir).unwrap().permissions().mode() & 0o777));
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            modes_under(&path, out);
        } else {
            out.push((path.clone(), std::fs::metadata(&path).unwrap().permissions().mode() & 0o777));
        }
    }
}

/// The data directory holds live lease ids (RocksDB's write-ahead log):
/// created 0700, every file in it 0600, whatever the caller's umask; a
/// data directory that is already wider is warned about at start.
#[test]
fn data_dir_and_its_files_are_private_to_the_gateway() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let gw = common::Gateway::start(&data, common::Opts::default());
    // A grant (its lease id goes to the log) and an object in the store.
    let api = gw.api_url("/v1/locks/acquire");
    let out = Command::new("curl")
        .args(["-sf", "-X", "POST", "-H", "content-type: application/json", "--data"])
        .arg(r#"{"key":"k/1","ttl_ms":30000}"#)
        .arg(&api)
        .output()
        .unwrap();
    assert!(out.status.success());
    let out = Command::new("curl")
        .args(["-sf", "-X", "PUT", "-H", "x-fencing-token: 1", "--data", "x"])
        .arg(gw.proxy_url("/k/1"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!gw.log_text().contains("accessible to other users"));
    let status = gw.terminate();
    assert!(status.success());
    let mut modes = Vec::new();
    modes_under(&data, &mut modes);
    assert!(modes.iter().any(|(p, _)| p.ends_with("objects/k/1")), "{modes:?}");
    assert!(modes.len() > 5, "{modes:?}");
    for (path, mode) in &modes {
        let want = if path.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(*mode, want, "{} is {mode:03o}", path.display());
    }

    // An existing data directory open to others: said at start.
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    let gw = common::Gateway::start(&data, common::Opts::default());
    assert!(gw.log_text().contains("accessible to other users"), "{}", gw.log_text());
}
