//! Every example runs against a gateway it starts itself and exits 0.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

fn example(name: &str) -> PathBuf {
    // target/<profile>/deps/examples-xxxx -> target/<profile>/examples/<name>
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    profile_dir.join("examples").join(name)
}

#[test]
fn gc_pause_example_refuses_the_zombie_write() {
    let path = example("gc_pause");
    assert!(path.exists(), "build the examples first (cargo build --all-targets): {}", path.display());
    let out = Command::new(path).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("fencing token 33"), "{stdout}");
    assert!(stdout.contains("fencing token 34"), "{stdout}");
    assert!(stdout.contains("HTTP 409"), "{stdout}");
    assert!(stdout.contains("stale_fencing_token"), "{stdout}");
}

#[test]
fn leader_election_example_fails_over_and_refuses_the_deposed_leader() {
    let path = example("leader_election");
    let out = Command::new(path).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("elected, term 2"), "{stdout}");
    assert!(stdout.contains("HTTP 409"), "{stdout}");
}

#[test]
fn job_queue_example_refuses_the_late_result() {
    let out = Command::new(example("job_queue")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("late result -> HTTP 409"), "{stdout}");
}

#[test]
fn python_legacy_writer_example_handles_409() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/python/legacy_writer.py");
    let out =
        Command::new("python3").arg(script).env("FENCEGATE_BIN", env!("CARGO_BIN_EXE_fencegate")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("HTTP 409"), "{stdout}");
    assert!(stdout.contains("late retry of #1: HTTP 409") && stdout.contains("stale_sequence"), "{stdout}");
    assert!(stdout.contains("the ledger holds: balance=20"), "{stdout}");
}

#[test]
fn reqwest_writer_example_is_fenced() {
    let out = Command::new(example("reqwest_writer")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("writer B writes with reqwest: HTTP 20"), "{stdout}");
    assert!(stdout.contains("writes again: HTTP 409"), "{stdout}");
    assert!(stdout.contains("\"final by B\""), "{stdout}");
}
