//! A real etcd cluster on free loopback ports for cluster-mode tests.
//! Members are separate processes, stopped by PID. A missing `etcd`
//! binary fails the test loudly (install the `etcd-server` package); it is
//! never skipped.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::free_port;

pub struct Member {
    pub name: String,
    pub child: Option<Child>,
    pub client_url: String,
    peer_url: String,
    data_dir: PathBuf,
    log: PathBuf,
}

pub struct EtcdCluster {
    pub members: Vec<Member>,
    initial_cluster: String,
    token: String,
    tls: Option<Tls>,
}

/// Client TLS of a cluster started by [`EtcdCluster::start_tls`]: members
/// serve https and ask every client for a certificate of `ca`.
#[derive(Clone)]
pub struct Tls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn etcd_binary() -> &'static str {
    let found = Command::new("etcd").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    assert!(
        found.is_ok_and(|s| s.success()),
        "the `etcd` binary is needed by the cluster-mode tests: install the etcd-server package \
         (scripts/setup-system.sh test)"
    );
    "etcd"
}

impl EtcdCluster {
    /// Starts `n` members under `dir` and waits until they have a leader.
    pub async fn start(dir: &Path, n: usize) -> EtcdCluster {
        Self::start_with(dir, n, None).await
    }

    /// [`EtcdCluster::start`] with client TLS: https client URLs, server
    /// certificate `tls.cert`/`tls.key` (for 127.0.0.1), and client
    /// certificates required (`--client-cert-auth`, signed by `tls.ca`).
    pub async fn start_tls(dir: &Path, n: usize, tls: Tls) -> EtcdCluster {
        Self::start_with(dir, n, Some(tls)).await
    }

    /// A port picked by [`free_port`] can be taken by another process
    /// before etcd binds it; that member then exits at once, and the whole
    /// cluster is started again on other ports.
    async fn start_with(dir: &Path, n: usize, tls: Option<Tls>) -> EtcdCluster {
        etcd_binary();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut c = Self::spawn_all(dir, n, tls.clone());
            if c.wait_healthy_or_exited(Duration::from_secs(30)).await {
                return c;
            }
            assert!(attempt < 4, "etcd members kept exiting at start: {}", c.logs());
            for i in 0..n {
                c.kill9(i);
                let _ = std::fs::remove_dir_all(&c.members[i].data_dir);
            }
        }
    }

    fn spawn_all(dir: &Path, n: usize, tls: Option<Tls>) -> EtcdCluster {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut members = Vec::new();
        for i in 0..n {
            let name = format!("e{i}");
            members.push(Member {
                client_url: format!("{scheme}://127.0.0.1:{}", free_port()),
                peer_url: format!("http://127.0.0.1:{}", free_port()),
                data_dir: dir.join(format!("{name}.etcd")),
                log: dir.join(format!("{name}.etcd.log")),
                name,
                child: None,
            });
        }
        let initial_cluster =
            members.iter().map(|m| format!("{}={}", m.name, m.peer_url)).collect::<Vec<_>>().join(",");
        let token = format!("fg-test-{}", free_port());
        let mut c = EtcdCluster { members, initial_cluster, token, tls };
        for i in 0..n {
            c.spawn(i);
        }
        c
    }

    /// True once a put succeeds through a quorum; false as soon as a member
    /// has exited (its ports were taken). Panics after `limit`.
    async fn wait_healthy_or_exited(&mut self, limit: Duration) -> bool {
        let started = Instant::now();
        loop {
            if self.members.iter_mut().any(|m| m.child.as_mut().is_some_and(|c| !matches!(c.try_wait(), Ok(None)))) {
                return false;
            }
            if self.put_probe().await {
                return true;
            }
            assert!(started.elapsed() < limit, "etcd cluster not healthy after {limit:?}: {}", self.logs());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn put_probe(&self) -> bool {
        if let Ok(mut c) = tokio::time::timeout(Duration::from_secs(2), self.client()).await {
            // Put and deleted again: a key left outside the gateways'
            // prefix would stop `raise-floor` padding etcd's log by itself.
            let probe = async {
                c.put("/health-probe", "1", None).await?;
                c.delete("/health-probe", None).await
            };
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), probe).await {
                return true;
            }
        }
        false
    }

    fn spawn(&mut self, i: usize) {
        let m = &self.members[i];
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&m.log).unwrap();
        let mut cmd = Command::new(etcd_binary());
        if let Some(tls) = &self.tls {
            cmd.arg("--cert-file").arg(&tls.cert).arg("--key-file").arg(&tls.key);
            cmd.arg("--trusted-ca-file").arg(&tls.ca).arg("--client-cert-auth");
        }
        let child = cmd
            .arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .arg("--listen-client-urls")
            .arg(&m.client_url)
            .arg("--advertise-client-urls")
            .arg(&m.client_url)
            .arg("--listen-peer-urls")
            .arg(&m.peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&m.peer_url)
            .arg("--initial-cluster")
            .arg(&self.initial_cluster)
            .arg("--initial-cluster-token")
            .arg(&self.token)
            .arg("--initial-cluster-state")
            .arg("new")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawning etcd");
        self.members[i].child = Some(child);
    }

    /// Every client URL, comma-separated (the `--etcd` flag's form).
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    /// The TOML list of the endpoints.
    pub fn endpoints_toml(&self) -> String {
        let list = self.endpoints().iter().map(|e| format!("{e:?}")).collect::<Vec<_>>().join(", ");
        format!("[{list}]")
    }

    /// A client to the members that are running.
    pub async fn client(&self) -> etcd_client::Client {
        let eps: Vec<String> =
            self.members.iter().filter(|m| m.child.is_some()).map(|m| m.client_url.clone()).collect();
        let mut opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(2))
            .with_require_leader(true);
        if let Some(tls) = &self.tls {
            let pem = |p: &Path| std::fs::read(p).unwrap();
            opts = opts.with_tls(
                etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(pem(&tls.ca)))
                    .identity(etcd_client::Identity::from_pem(pem(&tls.cert), pem(&tls.key))),
            );
        }
        etcd_client::Client::connect(eps, Some(opts)).await.unwrap()
    }

    /// Waits until a put succeeds through a quorum.
    pub async fn wait_healthy(&self, limit: Duration) {
        let started = Instant::now();
        loop {
            if self.put_probe().await {
                return;
            }
            assert!(started.elapsed() < limit, "etcd cluster not healthy after {limit:?}: {}", self.logs());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The index of the current leader.
    pub async fn leader(&self) -> usize {
        for _ in 0..100 {
            for (i, m) in self.members.iter().enumerate() {
                if m.child.is_none() {
                    continue;
                }
                let opts = etcd_client::ConnectOptions::new().with_timeout(Duration::from_secs(1));
                let Ok(mut c) = etcd_client::Client::connect([m.client_url.clone()], Some(opts)).await else {
                    continue;
                };
                if let Ok(s) = c.status().await {
                    let me = s.header().map(|h| h.member_id()).unwrap_or(0);
                    if s.leader() == me && me != 0 {
                        return i;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no etcd leader found");
    }

    pub fn pid(&self, i: usize) -> u32 {
        self.members[i].child.as_ref().unwrap().id()
    }

    /// SIGKILL member `i`.
    pub fn kill9(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Restarts a killed member on its data dir.
    pub fn restart(&mut self, i: usize) {
        assert!(self.members[i].child.is_none());
        self.spawn(i);
    }

    /// Saves a snapshot of the cluster's data (through member 0) to `path`.
    pub fn snapshot(&self, path: &Path) {
        assert!(self.tls.is_none(), "snapshots of TLS clusters are not needed by any test");
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg("--endpoints")
            .arg(&self.members[0].client_url)
            .arg("snapshot")
            .arg("save")
            .arg(path)
            .output()
            .expect("running etcdctl (etcd-client package)");
        assert!(out.status.success(), "etcdctl snapshot save: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// What an operator does to restore a cluster: every member stopped,
    /// its data replaced by `snapshot` restored under the same name, peer
    /// URL and cluster token (so the cluster keeps its cluster id), and
    /// started again.
    pub fn restore_all(&mut self, snapshot: &Path) {
        for i in 0..self.members.len() {
            self.kill9(i);
        }
        for m in &self.members {
            let _ = std::fs::remove_dir_all(&m.data_dir);
            let out = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .arg("snapshot")
                .arg("restore")
                .arg(snapshot)
                .arg("--name")
                .arg(&m.name)
                .arg("--data-dir")
                .arg(&m.data_dir)
                .arg("--initial-cluster")
                .arg(&self.initial_cluster)
                .arg("--initial-cluster-token")
                .arg(&self.token)
                .arg("--initial-advertise-peer-urls")
                .arg(&m.peer_url)
                .output()
                .expect("running etcdctl (etcd-client package)");
            assert!(out.status.success(), "etcdctl snapshot restore: {}", String::from_utf8_lossy(&out.stderr));
        }
        for i in 0..self.members.len() {
            self.spawn(i);
        }
    }

    pub fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| {
                let text = std::fs::read_to_string(&m.log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(5).collect();
                format!("--- {}\n{}", m.name, tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
            })
            .collect()
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill9(i);
        }
    }
}
