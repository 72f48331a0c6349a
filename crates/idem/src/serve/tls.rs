//! TLS on both sides of the gateway: the listener's certificate (`--tls-cert`, `--tls-key`) and
//! the roots an `https://` upstream is checked against (the system's, plus `--upstream-ca`).
//! Everything uses rustls with the *ring* provider, passed explicitly: no process-wide default is
//! needed, and the build does not compile aws-lc (a C library that takes minutes).

use std::path::Path;
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

use crate::cli::Misconfigured;

/// Marks a request that came in over the TLS listener, so that the upstream is told
/// `X-Forwarded-Proto: https`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OverTls;

/// The protocols the listener offers by ALPN, preferred first.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The TLS side of the listener: `None` without `--tls-cert` and `--tls-key`; both or neither.
pub(crate) fn listener(cert: Option<&Path>, key: Option<&Path>) -> Result<Option<TlsAcceptor>, Misconfigured> {
    let (cert, key) = match (cert, key) {
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(Misconfigured {
                flag: "tls-key",
                reason: "is required with --tls-cert: the PEM file of the certificate's private key".to_owned(),
            });
        }
        (None, Some(_)) => {
            return Err(Misconfigured {
                flag: "tls-cert",
                reason: "is required with --tls-key: the PEM file of the certificate chain, the server's first"
                    .to_owned(),
            });
        }
        (Some(cert), Some(key)) => (cert, key),
    };
    let chain = certificates("tls-cert", cert)?;
    let private_key = PrivateKeyDer::from_pem_file(key).map_err(|err| match err {
        rustls::pki_types::pem::Error::NoItemsFound => Misconfigured {
            flag: "tls-key",
            reason: format!(
                "{} holds no PEM private key (-----BEGIN PRIVATE KEY-----, RSA or EC)",
                key.display()
            ),
        },
        err => unreadable("tls-key", key, &err),
    })?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports the default protocol versions")
        .with_no_client_auth()
        .with_single_cert(chain, private_key)
        .map_err(|err| Misconfigured {
            flag: "tls-key",
            reason: format!(
                "{} cannot be used with the certificate in {}: {err}",
                key.display(),
                cert.display()
            ),
        })?;
    config.alpn_protocols = ALPN.iter().map(|protocol| protocol.to_vec()).collect();
    Ok(Some(TlsAcceptor::from(Arc::new(config))))
}

/// How an `https://` upstream is checked: against the system's roots (the platform's CA bundle,
/// or `SSL_CERT_FILE` / `SSL_CERT_DIR`), plus the CAs in `ca` (`--upstream-ca`). No ALPN yet: the
/// connector sets it.
pub(crate) fn upstream(ca: Option<&Path>) -> Result<ClientConfig, Misconfigured> {
    let mut roots = RootCertStore::empty();
    let system = rustls_native_certs::load_native_certs();
    for err in &system.errors {
        tracing::warn!(error = %err, "cannot load some of the system's CA certificates");
    }
    let (_, ignored) = roots.add_parsable_certificates(system.certs);
    if ignored > 0 {
        tracing::debug!(ignored, "system CA certificates rustls cannot use were skipped");
    }
    if let Some(ca) = ca {
        for cert in certificates("upstream-ca", ca)? {
            roots.add(cert).map_err(|err| Misconfigured {
                flag: "upstream-ca",
                reason: format!("{} holds a certificate that cannot be a root: {err}", ca.display()),
            })?;
        }
    }
    if roots.is_empty() {
        return Err(Misconfigured {
            flag: "upstream-ca",
            reason: "the upstream is https:// but no CA is trusted: the system has none (install its CA bundle, or set SSL_CERT_FILE) and --upstream-ca is not set".to_owned(),
        });
    }
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// A client configuration that trusts no one, for a connector that only ever dials `http://`.
pub(crate) fn unused() -> ClientConfig {
    ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports the default protocol versions")
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth()
}

/// Every certificate in the PEM file `path`, named by `flag` in errors; at least one.
fn certificates(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, Misconfigured> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|err| unreadable(flag, path, &err))?;
    if certs.is_empty() {
        return Err(Misconfigured {
            flag,
            reason: format!(
                "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                path.display()
            ),
        });
    }
    Ok(certs)
}

fn unreadable(flag: &'static str, path: &Path, err: &rustls::pki_types::pem::Error) -> Misconfigured {
    let reason = match err {
        rustls::pki_types::pem::Error::Io(err) => format!("cannot read {}: {err}", path.display()),
        err => format!("{} is not valid PEM: {err}", path.display()),
    };
    Misconfigured { flag, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[track_caller]
    fn refused(result: Result<Option<TlsAcceptor>, Misconfigured>) -> Misconfigured {
        match result {
            Ok(_) => panic!("accepted"),
            Err(err) => err,
        }
    }

    #[test]
    fn the_listener_needs_both_files() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path(), "x.pem", "");
        assert!(matches!(listener(None, None), Ok(None)));
        assert_eq!(refused(listener(Some(&file), None)).flag, "tls-key");
        assert_eq!(refused(listener(None, Some(&file))).flag, "tls-cert");
    }

    #[test]
    fn files_that_hold_no_pem_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let text = write(dir.path(), "text.pem", "not a certificate\n");
        let err = refused(listener(Some(&text), Some(&text)));
        assert_eq!(err.flag, "tls-cert");
        assert!(err.reason.contains("text.pem"), "{err}");
        let missing = dir.path().join("missing.pem");
        let err = upstream(Some(&missing)).unwrap_err();
        assert_eq!(err.flag, "upstream-ca");
        assert!(
            err.reason.contains("cannot read") && err.reason.contains("missing.pem"),
            "{err}"
        );
    }
}
