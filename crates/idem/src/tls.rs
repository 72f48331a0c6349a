//! TLS on both sides of the gateway: the listener's certificate (`--tls-cert`, `--tls-key`) and
//! how an `https://` upstream is checked (the system's roots plus `--upstream-ca`, whose
//! certificates are also accepted as pinned).
//! Everything uses rustls with the *ring* provider, passed explicitly: no process-wide default is
//! needed, and the build does not compile aws-lc (a C library that takes minutes).

use std::path::Path;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use tokio_rustls::TlsAcceptor;

use crate::misconfigured::Misconfigured;

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
/// or `SSL_CERT_FILE` / `SSL_CERT_DIR`), plus the CAs in `ca` (`--upstream-ca`), whose
/// certificates are also accepted as pinned ([`PinnedOrRoots`]). No ALPN yet: the connector
/// sets it.
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
    let mut pinned = Vec::new();
    if let Some(ca) = ca {
        for cert in certificates("upstream-ca", ca)? {
            roots.add(cert.clone()).map_err(|err| Misconfigured {
                flag: "upstream-ca",
                reason: format!("{} holds a certificate that cannot be a root: {err}", ca.display()),
            })?;
            pinned.push(cert);
        }
    }
    if roots.is_empty() {
        return Err(Misconfigured {
            flag: "upstream-ca",
            reason: "the upstream is https:// but no CA is trusted: the system has none (install its CA bundle, or set SSL_CERT_FILE) and --upstream-ca is not set".to_owned(),
        });
    }
    let roots = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|err| Misconfigured {
            flag: "upstream-ca",
            reason: format!("the upstream's certificates cannot be checked: {err}"),
        })?;
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedOrRoots { roots, pinned }))
        .with_no_client_auth())
}

/// Checks an upstream's certificate against the roots (webpki) and, when they refuse it, as
/// pinned: byte for byte one of `--upstream-ca`'s certificates. What `openssl req -x509` makes
/// is a CA (CA:TRUE) used as its own leaf, which webpki refuses as a server's certificate
/// (`CaUsedAsEndEntity`) even when it is a trusted root; an operator who gives that very
/// certificate means to trust it, as curl and nginx users expect. A pinned certificate must still
/// name the upstream and be valid now, and the handshake must be signed by its key.
#[derive(Debug)]
struct PinnedOrRoots {
    roots: Arc<WebPkiServerVerifier>,
    pinned: Vec<CertificateDer<'static>>,
}

impl ServerCertVerifier for PinnedOrRoots {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let refused = match self
            .roots
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Ok(verified) => return Ok(verified),
            Err(err) => err,
        };
        if !self.pinned.iter().any(|pinned| pinned.as_ref() == end_entity.as_ref()) {
            // webpki says `CaUsedAsEndEntity` of any such certificate before it looks for an
            // issuer, which tells an operator nothing about what to do.
            if matches!(refused, rustls::Error::InvalidCertificate(CertificateError::Other(_))) && is_ca(end_entity) {
                return Err(rustls::Error::InvalidCertificate(CertificateError::Other(
                    rustls::OtherError(Arc::new(NotPinned)),
                )));
            }
            return Err(refused);
        }
        check_pinned(end_entity, server_name, now)?;
        Ok(ServerCertVerified::assertion())
    }

    // The handshake's signature is checked as for any certificate: by the key in the one the
    // server presented, pinned or not.
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.roots.supported_verify_schemes()
    }
}

/// Whether `cert` says it is a CA (basic constraints `CA:TRUE`).
fn is_ca(cert: &CertificateDer<'_>) -> bool {
    x509_parser::parse_x509_certificate(cert.as_ref()).is_ok_and(|(_, x509)| x509.is_ca())
}

/// A server presented a CA certificate as its own, and it is not one of `--upstream-ca`'s.
#[derive(thiserror::Error)]
#[error(
    "the upstream presents a CA certificate (CA:TRUE, as `openssl req -x509` makes) as its own, which is accepted only when it is one of the --upstream-ca certificates, and it is not"
)]
struct NotPinned;

impl std::fmt::Debug for NotPinned {
    /// rustls shows a certificate error by its `Debug`: the sentence, then.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// What is still checked of a pinned certificate: that it names `server_name` and is valid at
/// `now`.
fn check_pinned(cert: &CertificateDer<'_>, server_name: &ServerName<'_>, now: UnixTime) -> Result<(), rustls::Error> {
    let parsed = ParsedCertificate::try_from(cert)?;
    rustls::client::verify_server_name(&parsed, server_name)?;
    let (_, x509) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
    let validity = x509.validity();
    let now = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
    if now < validity.not_before.timestamp() {
        return Err(rustls::Error::InvalidCertificate(CertificateError::NotValidYet));
    }
    if now > validity.not_after.timestamp() {
        return Err(rustls::Error::InvalidCertificate(CertificateError::Expired));
    }
    Ok(())
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
