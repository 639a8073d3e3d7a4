//! rustls configurations from PEM files: listener configs (ALPN `h2` and
//! `http/1.1`, TLS 1.2+ only, optional client-certificate verification)
//! that can be reloaded on SIGHUP without touching open connections, and
//! the client certificate's common name for principals.
//!
//! The crypto provider is `ring`, chosen explicitly so that no second C
//! build (aws-lc) enters the tree. This module reads files; it never opens
//! sockets.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use serde::Deserialize;

use crate::error::Error;

/// TLS settings of one listener (`[server.proxy_tls]`, `[server.api_tls]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// PEM CA bundle for client certificates; enables mTLS.
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
    /// With a `client_ca_file`: refuse handshakes without a valid client
    /// certificate (default). `false` makes the certificate optional.
    #[serde(default = "yes")]
    pub require_client_cert: bool,
}

fn yes() -> bool {
    true
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| Error::Config(format!("reading certificates from {}: {e}", path.display())))?
        .collect::<Result<_, _>>()
        .map_err(|e| Error::Config(format!("parsing certificates in {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(Error::Config(format!("{} holds no certificate", path.display())));
    }
    Ok(certs)
}

/// Builds a listener config from PEM files.
pub fn server_config(s: &TlsSettings) -> Result<Arc<ServerConfig>, Error> {
    let certs = read_certs(&s.cert_file)?;
    let key = PrivateKeyDer::from_pem_file(&s.key_file)
        .map_err(|e| Error::Config(format!("reading the private key {}: {e}", s.key_file.display())))?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| Error::Internal(format!("TLS versions: {e}")))?;
    let builder = match &s.client_ca_file {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in read_certs(ca)? {
                roots.add(cert).map_err(|e| Error::Config(format!("CA in {}: {e}", ca.display())))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
            let verifier = if s.require_client_cert { verifier } else { verifier.allow_unauthenticated() };
            let verifier = verifier.build().map_err(|e| Error::Config(format!("client verifier: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| Error::Config(format!("certificate and key of {}: {e}", s.cert_file.display())))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A listener config that SIGHUP can replace. New handshakes use the new
/// config; established connections keep theirs.
#[derive(Debug)]
pub struct Reloadable {
    settings: TlsSettings,
    current: RwLock<Arc<ServerConfig>>,
}

impl Reloadable {
    /// Loads the files once.
    pub fn load(settings: TlsSettings) -> Result<Arc<Reloadable>, Error> {
        let config = server_config(&settings)?;
        Ok(Arc::new(Reloadable { settings, current: RwLock::new(config) }))
    }

    /// The config for the next handshake.
    pub fn current(&self) -> Option<Arc<ServerConfig>> {
        self.current.read().ok().map(|c| c.clone())
    }

    /// Re-reads the files; on error the old config stays in use.
    pub fn reload(&self) -> Result<(), Error> {
        let config = server_config(&self.settings)?;
        if let Ok(mut c) = self.current.write() {
            *c = config;
        }
        Ok(())
    }
}

/// Client-side TLS files: for `https://` upstreams and for the Rust client
/// (one type, the client crate's).
pub use fencegate_client::TlsFiles;

/// A client config for `https://` upstreams: the client crate's (the CA
/// bundle or the system roots, TLS 1.2+, an optional client certificate).
pub fn client_config(tls: &TlsFiles) -> Result<rustls::ClientConfig, Error> {
    fencegate_client::client_config(tls).map_err(Error::Config)
}

/// The first common name (CN) of a certificate's subject, if any.
pub fn subject_cn(cert: &[u8]) -> Option<String> {
    // Certificate ::= SEQUENCE { tbsCertificate, ... }
    let (cert_body, _) = der_take(cert, 0x30)?;
    let (tbs, _) = der_take(cert_body, 0x30)?;
    let mut rest = tbs;
    // [0] EXPLICIT version, optional.
    if rest.first() == Some(&0xa0) {
        rest = der_take(rest, 0xa0)?.1;
    }
    rest = der_take(rest, 0x02)?.1; // serialNumber
    rest = der_take(rest, 0x30)?.1; // signature AlgorithmIdentifier
    rest = der_take(rest, 0x30)?.1; // issuer Name
    rest = der_take(rest, 0x30)?.1; // validity
    let (mut subject, _) = der_take(rest, 0x30)?; // subject Name
    const CN_OID: &[u8] = &[0x55, 0x04, 0x03];
    while !subject.is_empty() {
        let (mut set, next) = der_take(subject, 0x31)?;
        subject = next;
        while !set.is_empty() {
            let (atv, next) = der_take(set, 0x30)?;
            set = next;
            let (oid, value) = der_take(atv, 0x06)?;
            if oid == CN_OID {
                let tag = *value.first()?;
                let (text, _) = der_take(value, tag)?;
                return String::from_utf8(text.to_vec()).ok();
            }
        }
    }
    None
}

/// Splits one DER element with tag `tag` off the front: (contents, rest).
fn der_take(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    if *input.first()? != tag {
        return None;
    }
    let first = *input.get(1)?;
    let (len, header) = if first < 0x80 {
        (usize::from(first), 2)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let bytes = input.get(2..2 + n)?;
        (bytes.iter().fold(0usize, |acc, b| (acc << 8) | usize::from(*b)), 2 + n)
    };
    let end = header.checked_add(len)?;
    Some((input.get(header..end)?, input.get(end..)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_name_is_read_from_a_generated_certificate() {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
        params.distinguished_name.push(rcgen::DnType::OrganizationName, "Acme");
        params.distinguished_name.push(rcgen::DnType::CommonName, "billing-worker");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(subject_cn(cert.der()).as_deref(), Some("billing-worker"));
    }

    #[test]
    fn garbage_has_no_common_name() {
        assert_eq!(subject_cn(&[]), None);
        assert_eq!(subject_cn(&[0x30, 0x82, 0xff]), None);
        assert_eq!(subject_cn(&[0x30, 0x03, 0x30, 0x01, 0x00]), None);
    }

    #[test]
    fn missing_files_are_named() {
        let s = TlsSettings {
            cert_file: "/nonexistent/cert.pem".into(),
            key_file: "/nonexistent/key.pem".into(),
            client_ca_file: None,
            require_client_cert: true,
        };
        let err = server_config(&s).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/cert.pem"), "{err}");
    }
}
