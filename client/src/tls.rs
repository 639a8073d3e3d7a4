//! TLS for `https://` lease API URLs (and the gateway's `https://`
//! upstreams, which use this same config).

/// Client-side TLS files: for `https://` upstreams and for the Rust client.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// PEM CA bundle to trust instead of the system roots.
    pub ca_file: Option<std::path::PathBuf>,
    /// PEM client certificate chain and key, for upstreams that want mTLS.
    pub client_cert_file: Option<std::path::PathBuf>,
    pub client_key_file: Option<std::path::PathBuf>,
}

/// A client config: the CA bundle (or the system roots), TLS 1.2+, and an
/// optional client certificate. ALPN is left to the connector.
pub fn client_config(tls: &TlsFiles) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    match &tls.ca_file {
        Some(ca) => {
            let certs = CertificateDer::pem_file_iter(ca).map_err(|e| format!("reading {}: {e}", ca.display()))?;
            for cert in certs {
                let cert = cert.map_err(|e| format!("parsing {}: {e}", ca.display()))?;
                roots.add(cert).map_err(|e| format!("CA in {}: {e}", ca.display()))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for cert in native.certs {
                let _ = roots.add(cert);
            }
        }
    }
    let builder =
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| format!("TLS versions: {e}"))?
            .with_root_certificates(roots);
    // ALPN is set by the connector (http/1.1).
    let config = match (&tls.client_cert_file, &tls.client_key_file) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("reading {}: {e}", cert.display()))?;
            let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("reading {}: {e}", key.display()))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| format!("client certificate: {e}"))?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => return Err("client_cert_file and client_key_file go together".into()),
    };
    Ok(config)
}
