//! TLS on both listeners with certificates generated at test time: a
//! handshake with a good client certificate succeeds, one without fails
//! when mTLS is required, h2 is negotiated by ALPN, SIGHUP reloads the
//! certificate without dropping open connections, and `https://`
//! upstreams are verified against a configured CA.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use common::{Gateway, Opts};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::TlsConnector;

struct Pki {
    dir: PathBuf,
    ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Pki {
    fn new(dir: &Path) -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, "fencegate test CA");
        let key = KeyPair::generate().unwrap();
        let ca = params.self_signed(&key).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        Pki { dir: dir.to_path_buf(), ca_pem: ca.pem(), issuer: Issuer::new(params, key) }
    }

    /// Writes NAME.pem and NAME.key signed by the CA; returns their paths.
    fn issue(&self, name: &str, cn: &str, sans: &[&str]) -> (PathBuf, PathBuf) {
        let mut params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let (c, k) = (self.dir.join(format!("{name}.pem")), self.dir.join(format!("{name}.key")));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }

    fn connector(&self, client: Option<(&Path, &Path)>, alpn: &[&[u8]]) -> TlsConnector {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_slice(self.ca_pem.as_bytes()).unwrap()).unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let mut config = match client {
            Some((c, k)) => {
                let chain = CertificateDer::pem_file_iter(c).unwrap().collect::<Result<Vec<_>, _>>().unwrap();
                builder.with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(k).unwrap()).unwrap()
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        TlsConnector::from(Arc::new(config))
    }
}

/// One GET over a fresh TLS connection; `Err` if the handshake or the
/// exchange fails. Returns the status and the negotiated ALPN protocol.
async fn get(
    connector: &TlsConnector,
    addr: std::net::SocketAddr,
    path: &str,
    h2: bool,
) -> Result<(StatusCode, Option<Vec<u8>>), String> {
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let tls = connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await.map_err(|e| e.to_string())?;
    let alpn = tls.get_ref().1.alpn_protocol().map(|p| p.to_vec());
    let req = Request::get(format!("https://localhost{path}")).body(Empty::<Bytes>::new()).unwrap();
    let resp = if h2 {
        let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        send.send_request(req).await.map_err(|e| e.to_string())?
    } else {
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        send.send_request(req).await.map_err(|e| e.to_string())?
    };
    let status = resp.status();
    resp.into_body().collect().await.map_err(|e| e.to_string())?;
    Ok((status, alpn))
}

fn tls_config(pki: &Pki, server: &(PathBuf, PathBuf)) -> String {
    format!(
        r#"
[server.api_tls]
cert_file = "{c}"
key_file = "{k}"
client_ca_file = "{ca}"
require_client_cert = true

[server.proxy_tls]
cert_file = "{c}"
key_file = "{k}"
"#,
        c = server.0.display(),
        k = server.1.display(),
        ca = pki.dir.join("ca.pem").display()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn mtls_on_the_api_and_alpn_h2_on_both() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let server = pki.issue("server", "fencegate", &["localhost", "127.0.0.1"]);
    let client = pki.issue("client", "billing-worker", &[]);
    let gw =
        Gateway::start(&dir.path().join("data"), Opts { config: Some(tls_config(&pki, &server)), ..Opts::default() });

    let with_cert = pki.connector(Some((&client.0, &client.1)), &[b"h2", b"http/1.1"]);
    let (status, alpn) = get(&with_cert, gw.api, "/healthz", true).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(alpn.as_deref(), Some(&b"h2"[..]), "h2 negotiated by ALPN");
    let h1 = pki.connector(Some((&client.0, &client.1)), &[b"http/1.1"]);
    let (status, alpn) = get(&h1, gw.api, "/healthz", false).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));

    // No client certificate: mTLS is required on the api listener.
    let without = pki.connector(None, &[b"h2", b"http/1.1"]);
    assert!(
        get(&without, gw.api, "/healthz", false).await.is_err(),
        "the api must refuse a client without a certificate"
    );
    // A certificate from another CA is refused too.
    let other_dir = tempfile::tempdir().unwrap();
    let other = Pki::new(other_dir.path());
    let stranger = other.issue("stranger", "billing-worker", &[]);
    let forged = pki.connector(Some((&stranger.0, &stranger.1)), &[b"http/1.1"]);
    assert!(get(&forged, gw.api, "/healthz", false).await.is_err());

    // The proxy listener has TLS without mTLS.
    let (status, alpn) = get(&without, gw.proxy, "/nothing-here", true).await.unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(alpn.as_deref(), Some(&b"h2"[..]));
    // Plain text on a TLS listener gets nowhere.
    let plain = common::Http::default().try_send(http::Method::GET, &gw.api_url("/healthz"), &[], "").await;
    assert!(plain.is_err());
}

#[tokio::test(flavor = "multi_thread")]
async fn sighup_reloads_certificates_without_dropping_connections() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let server = pki.issue("server", "first", &["localhost"]);
    let client = pki.issue("client", "c", &[]);
    let gw =
        Gateway::start(&dir.path().join("data"), Opts { config: Some(tls_config(&pki, &server)), ..Opts::default() });
    let connector = pki.connector(Some((&client.0, &client.1)), &[b"http/1.1"]);

    // An open keep-alive connection before the reload.
    let tcp = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let tls = connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
    let first_cert = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    let r = send.send_request(Request::get("/x").body(Empty::<Bytes>::new()).unwrap()).await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);

    // New certificate files, then SIGHUP.
    pki.issue("server", "second", &["localhost"]);
    common::signal(gw.child.id(), "HUP");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let tcp = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let tls = connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
    let second_cert = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    assert_ne!(first_cert, second_cert, "new handshakes must get the reloaded certificate");
    assert_eq!(fencegate::tls::subject_cn(&second_cert).as_deref(), Some("second"));
    // The old connection still works.
    let r = send.send_request(Request::get("/y").body(Empty::<Bytes>::new()).unwrap()).await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert!(gw.log_text().contains("TLS certificates reloaded"));
}

#[tokio::test(flavor = "multi_thread")]
async fn https_upstream_is_verified_against_the_configured_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let up = pki.issue("upstream", "upstream", &["localhost", "127.0.0.1"]);
    // A TLS upstream that answers every request with its path.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up_addr = listener.local_addr().unwrap();
    // The upstream wants a client certificate from the gateway (mTLS).
    let gateway_cert = pki.issue("gateway-client", "fencegate-gateway", &[]);
    let settings = fencegate::tls::TlsSettings {
        cert_file: up.0.clone(),
        key_file: up.1.clone(),
        client_ca_file: Some(pki.dir.join("ca.pem")),
        require_client_cert: true,
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(fencegate::tls::server_config(&settings).unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let svc = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
                    let path = req.uri().path().to_string();
                    Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(Bytes::from(path))))
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), svc).await;
            });
        }
    });
    let cfg = format!(
        "[[routes]]\nname = \"trusted\"\nmatch = \"/trusted/{{*p}}\"\nupstream = \"https://localhost:{port}\"\nca_file = \"{ca}\"\n\
         client_cert_file = \"{cc}\"\nclient_key_file = \"{ck}\"\n\
         [[routes]]\nname = \"nocert\"\nmatch = \"/nocert/{{*p}}\"\nupstream = \"https://localhost:{port}\"\nca_file = \"{ca}\"\n\
         [[routes]]\nname = \"untrusted\"\nmatch = \"/untrusted/{{*p}}\"\nupstream = \"https://localhost:{port}\"\n",
        port = up_addr.port(),
        ca = pki.dir.join("ca.pem").display(),
        cc = gateway_cert.0.display(),
        ck = gateway_cert.1.display()
    );
    let gw = Gateway::start(&dir.path().join("data"), Opts { config: Some(cfg), ..Opts::default() });
    let http = common::Http::default();
    let r = http.get(&gw.proxy_url("/trusted/a")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], b"/trusted/a");
    // Without the client certificate the upstream refuses the gateway.
    let r = http.get(&gw.proxy_url("/nocert/a")).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    // The system roots do not know the test CA: the gateway refuses to talk.
    let r = http.get(&gw.proxy_url("/untrusted/a")).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
}

#[tokio::test(flavor = "multi_thread")]
async fn rust_client_and_cli_speak_mtls_to_the_api() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let server = pki.issue("server", "fencegate", &["localhost", "127.0.0.1"]);
    let client = pki.issue("client", "worker", &[]);
    let gw =
        Gateway::start(&dir.path().join("data"), Opts { config: Some(tls_config(&pki, &server)), ..Opts::default() });
    let url = format!("https://localhost:{}", gw.api.port());
    let files = fencegate::client::TlsFiles {
        ca_file: Some(pki.dir.join("ca.pem")),
        client_cert_file: Some(client.0.clone()),
        client_key_file: Some(client.1.clone()),
    };
    let c = fencegate::client::Client::with_tls(&url, &files).unwrap();
    let lease = c.acquire("tls/key", std::time::Duration::from_secs(5), std::time::Duration::ZERO).await.unwrap();
    assert_eq!(lease.token(), 1);
    lease.release().await.unwrap();
    // Without a client certificate the api refuses the client.
    let no_cert = fencegate::client::TlsFiles { ca_file: Some(pki.dir.join("ca.pem")), ..Default::default() };
    let c = fencegate::client::Client::with_tls(&url, &no_cert).unwrap();
    assert!(matches!(c.status("tls/key").await, Err(fencegate::client::ClientError::Unreachable(_))));
    // The command line, with the same files.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["status", "tls/key", "--url", &url])
        .arg("--ca-file")
        .arg(pki.dir.join("ca.pem"))
        .arg("--client-cert")
        .arg(&client.0)
        .arg("--client-key")
        .arg(&client.1)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["fence"], 1);
}
