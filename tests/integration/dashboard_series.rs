//! Every series the Grafana dashboard and the alert rules select exists on
//! a fresh gateway, at 0, before anything has happened: a panel over a
//! gateway that has seen no waits, no stale writes and no expiries shows 0,
//! not "No data" (docs/metrics.md). The selectors are read from the files
//! themselves, so a new panel over a series that appears only later fails
//! here.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{Gateway, Http, Opts, Recorder};
use serde_json::Value;

const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/grafana/dashboards/fencegate.json");
const RULES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/grafana/prometheus/alerts.yml");

/// One selector: a metric name and its label matchers `(label, op, value)`.
#[derive(Debug)]
struct Selector {
    name: String,
    matchers: Vec<(String, String, String)>,
}

/// The `fencegate_…` selectors of one PromQL expression (or of Grafana's
/// `label_values(metric, label)`).
fn selectors(expr: &str) -> Vec<Selector> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("fencegate_") {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        let name = tail[..end].to_string();
        let mut matchers = Vec::new();
        let mut after = &tail[end..];
        if let Some(body) = after.strip_prefix('{') {
            let close = body.find('}').unwrap();
            for m in body[..close].split(',').map(str::trim).filter(|m| !m.is_empty()) {
                let op_at = m.find(['=', '!']).unwrap();
                let op_len = if m[op_at + 1..].starts_with(['=', '~']) { 2 } else { 1 };
                let label = m[..op_at].trim().to_string();
                let op = m[op_at..op_at + op_len].to_string();
                let value = m[op_at + op_len..].trim().trim_matches('"').to_string();
                matchers.push((label, op, value));
            }
            after = &body[close + 1..];
        }
        out.push(Selector { name, matchers });
        rest = after;
    }
    out
}

/// Every expression of the dashboard (panels, variables) and the rules.
fn queried() -> Vec<(String, String)> {
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    let mut out = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            out.push((p["title"].as_str().unwrap().to_string(), t["expr"].as_str().unwrap().to_string()));
        }
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        out.push((format!("variable {}", v["name"]), v["query"]["query"].as_str().unwrap().to_string()));
    }
    for line in std::fs::read_to_string(RULES).unwrap().lines() {
        if let Some(expr) = line.trim().strip_prefix("expr:") {
            out.push(("alert rule".to_string(), expr.trim().to_string()));
        }
    }
    out
}

/// The series of a Prometheus text exposition: name and labels.
fn exposed(text: &str) -> Vec<(String, Vec<(String, String)>)> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let series = line.rsplit_once(' ').unwrap().0;
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (series, ""),
        };
        let labels = labels
            .split("\",")
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap();
                (k.to_string(), v.trim_matches('"').to_string())
            })
            .collect();
        out.push((name.to_string(), labels));
    }
    out
}

/// A matcher against one label value. Grafana variables (`$route`) match
/// anything; a regex is taken as `a|b|c` alternatives.
fn matches(op: &str, want: &str, have: Option<&str>) -> bool {
    let have = have.unwrap_or("");
    match op {
        "=" => have == want,
        "!=" => have != want,
        "=~" => want.contains('$') || want.split('|').any(|w| w == have),
        "!~" => want.contains('$') || !want.split('|').any(|w| w == have),
        _ => panic!("unknown matcher {op}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_series_the_dashboard_queries_exists_on_a_fresh_gateway() {
    let rec = Recorder::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&dir.path().join("data"), Opts { upstream: Some(rec.url()), ..Opts::default() });
    let text = String::from_utf8(Http::default().get(&gw.api_url("/metrics")).await.body.to_vec()).unwrap();
    let series = exposed(&text);
    let mut missing = Vec::new();
    let mut checked = 0;
    for (panel, expr) in queried() {
        for sel in selectors(&expr) {
            checked += 1;
            let found = series.iter().any(|(name, labels)| {
                name == &sel.name
                    && sel.matchers.iter().all(|(label, op, want)| {
                        let have = labels.iter().find(|(k, _)| k == label).map(|(_, v)| v.as_str());
                        // A label the query names must exist on the series.
                        (have.is_some() || op == "!=") && matches(op, want, have)
                    })
            });
            if !found {
                missing.push(format!("{panel}: {} {:?}", sel.name, sel.matchers));
            }
        }
    }
    assert!(checked >= 25, "only {checked} selectors found: the parser lost some");
    assert!(missing.is_empty(), "series absent on a fresh gateway:\n{}\n\n/metrics:\n{text}", missing.join("\n"));
}

#[test]
fn the_selector_parser_reads_matchers() {
    let s = selectors(
        "histogram_quantile(0.5, sum by (le) (rate(fencegate_lock_wait_seconds_bucket{outcome=\"granted\", \
         route=~\"$route\"}[5m]))) / sum(fencegate_leases_active)",
    );
    assert_eq!(s.len(), 2);
    assert_eq!(s[0].name, "fencegate_lock_wait_seconds_bucket");
    assert_eq!(s[0].matchers[0], ("outcome".into(), "=".into(), "granted".into()));
    assert_eq!(s[0].matchers[1], ("route".into(), "=~".into(), "$route".into()));
    assert_eq!(s[1].name, "fencegate_leases_active");
    assert!(s[1].matchers.is_empty());
}
