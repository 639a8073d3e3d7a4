//! The Grafana dashboard and the alert rules, checked by a real Prometheus
//! scraping a real gateway that this test drives through grants, renewals,
//! expiries, waits and stale writes. Every PromQL expression must parse and
//! name only metrics the gateway exports; the stale-writes panel must show
//! a value above zero. `promtool check rules` must accept the rules.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{acquire, release, Gateway, Http, Opts, Recorder};
use http::Method;
use serde_json::Value;

const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/grafana/dashboards/fencegate.json");
const RULES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/grafana/prometheus/alerts.yml");

fn find_tool(name: &str) -> String {
    let out = Command::new("sh").arg("-c").arg(format!("command -v {name}")).output().unwrap();
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(!path.is_empty(), "{name} is not installed: scripts/setup-system.sh test installs Debian's prometheus");
    path
}

struct KillOnDrop(Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every PromQL expression of the dashboard (panels and variables), with
/// Grafana's variables replaced as Grafana would.
fn dashboard_exprs() -> Vec<(String, String)> {
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    let mut out = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            out.push((p["title"].as_str().unwrap().to_string(), t["expr"].as_str().unwrap().to_string()));
        }
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        let q = v["query"]["query"].as_str().unwrap();
        // label_values(metric, label) is Grafana's; check its metric.
        let metric = q.trim_start_matches("label_values(").split(',').next().unwrap().trim();
        out.push((format!("variable {}", v["name"]), metric.to_string()));
    }
    out.into_iter().map(|(t, e)| (t, e.replace("$__rate_interval", "1m").replace("$route", ".*"))).collect()
}

fn rule_exprs() -> Vec<String> {
    std::fs::read_to_string(RULES)
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr:").map(|e| e.trim().to_string()))
        .collect()
}

fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(pos) = expr[i..].find("fencegate_") {
        let start = i + pos;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let name = &expr[start..end];
        let base = ["_bucket", "_sum", "_count"].iter().fold(name, |n, s| n.strip_suffix(s).unwrap_or(n));
        names.insert(base.to_string());
        i = end;
    }
    names
}

#[test]
fn promtool_accepts_the_alert_rules() {
    let promtool = find_tool("promtool");
    let out = Command::new(promtool).args(["check", "rules", RULES]).output().unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(rule_exprs().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dashboard_queries_evaluate_against_a_real_prometheus() {
    let prometheus = find_tool("prometheus");
    let rec = Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { upstream: Some(rec.url()), ..Opts::default() });
    let http = Http::default();
    let api = gw.api_url("");

    // Prometheus scraping the api listener every second.
    let prom_port = common::free_port();
    let cfg = dir.path().join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {RULES}\nscrape_configs:\n  - job_name: fencegate\n    static_configs:\n      - targets: [\"{}\"]\n",
            gw.api
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let _prom = KillOnDrop(
        Command::new(prometheus)
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );

    // Drive the gateway: grants, renewals, expiries, waiters, stale writes.
    let stop = Arc::new(AtomicBool::new(false));
    let driver = tokio::spawn({
        let (http, api, proxy, stop) = (http.clone(), api.clone(), gw.proxy_url(""), stop.clone());
        async move {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) && round < 400 {
                round += 1;
                let key = format!("orders/{}", round % 3);
                let old = acquire(&http, &api, &key, 150, 0).await;
                let Ok(old) = old else { continue };
                let body = serde_json::json!({"key": key, "lease_id": old.lease_id});
                http.post_json(&format!("{api}/v1/locks/renew"), body).await;
                let t = old.token.to_string();
                http.send(Method::PUT, &format!("{proxy}/{key}"), &[("x-fencing-token", &t)], "v").await;
                // A contender waits while the lease runs out: an expiry.
                let new = acquire(&http, &api, &key, 5000, 1000).await.unwrap();
                // The zombie comes back: refused as stale.
                http.send(Method::PUT, &format!("{proxy}/{key}"), &[("x-fencing-token", &t)], "late").await;
                let _ = acquire(&http, &api, &key, 1000, 0).await; // locked
                release(&http, &api, &new).await;
            }
        }
    });

    let prom = format!("http://127.0.0.1:{prom_port}");
    let query = |q: String| {
        let (http, prom) = (http.clone(), prom.clone());
        async move {
            let r = http.try_send(Method::GET, &format!("{prom}/api/v1/query?query={}", encode(&q)), &[], "").await;
            r.ok().and_then(|r| serde_json::from_slice::<Value>(&r.body).ok())
        }
    };

    // The stale-writes panel must show stale writes being stopped.
    let stale_expr = dashboard_exprs()
        .into_iter()
        .find(|(title, _)| title.starts_with("Stale writes refused"))
        .map(|(_, e)| e)
        .unwrap();
    let started = Instant::now();
    let stale_value = loop {
        let v = query(stale_expr.clone()).await;
        let value = v
            .as_ref()
            .and_then(|v| v["data"]["result"].as_array().cloned())
            .and_then(|r| r.first().cloned())
            .and_then(|s| s["value"][1].as_str().and_then(|x| x.parse::<f64>().ok()));
        if let Some(x) = value.filter(|x| *x > 0.0) {
            break x;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "stale-writes panel never showed a value: {v:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!("stale writes refused per second (panel): {stale_value}");

    // Every metric a query names is exported by the gateway.
    let exported: BTreeSet<String> = String::from_utf8(http.get(&gw.api_url("/metrics")).await.body.to_vec())
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    let mut all = dashboard_exprs();
    all.extend(rule_exprs().into_iter().map(|e| ("alert rule".to_string(), e)));
    for (title, expr) in &all {
        for name in metric_names(expr) {
            assert!(exported.contains(&name), "{title}: {name} is not exported by the gateway");
        }
        let v = query(expr.clone()).await.unwrap_or_else(|| panic!("{title}: no answer for {expr}"));
        assert_eq!(v["status"], "success", "{title}: {expr}: {v}");
    }
    // A query naming something the gateway does not export would fail the
    // name check above; prove the check bites.
    assert!(!exported.contains("fencegate_no_such_metric"));
    assert!(metric_names("rate(fencegate_no_such_metric_total[1m])").iter().any(|n| !exported.contains(n)));
    stop.store(true, Ordering::Relaxed);
    driver.await.unwrap();
    println!("{} dashboard and rule expressions evaluated", all.len());
}
