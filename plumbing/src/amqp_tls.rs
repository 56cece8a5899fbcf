//! TLS for `amqps://` connections: which CA certificates to trust, and an optional client
//! certificate. The server certificate is always verified (against the system's roots plus the CA
//! file), including its host name.

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use std::path::{Path, PathBuf};

/// Certificate files for `amqps://` URLs. Unused for `amqp://` URLs.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct AmqpTls {
    /// PEM file of CA certificates to trust for `amqps://` URLs, besides the system's (e.g. a
    /// private CA that signed the broker's certificate).
    #[arg(long = "amqp-ca-file", env = "AMQP_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate for brokers that require one (with `--amqp-key-file`).
    #[arg(long = "amqp-cert-file", env = "AMQP_CERT_FILE", requires = "key_file")]
    pub cert_file: Option<PathBuf>,
    /// PEM (PKCS#8, RSA or SEC1) private key of the client certificate.
    #[arg(long = "amqp-key-file", env = "AMQP_KEY_FILE", requires = "cert_file")]
    pub key_file: Option<PathBuf>,
}

/// A certificate file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AmqpTlsError {
    #[error("cannot read {what} {path}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {path} holds no PEM {expected}")]
    NotPem {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
    #[error("a client certificate needs both --amqp-cert-file and --amqp-key-file")]
    Incomplete,
}

impl AmqpTls {
    /// Trusts the CA certificates in `ca_file` (no client certificate).
    pub fn with_ca_file(ca_file: impl Into<PathBuf>) -> Self {
        Self {
            ca_file: Some(ca_file.into()),
            ..Self::default()
        }
    }

    /// Reads the files into lapin's TLS settings; an unreadable file or one without the expected
    /// PEM block is an error here rather than a puzzling handshake failure later.
    pub fn load(&self) -> Result<OwnedTLSConfig, AmqpTlsError> {
        let cert_chain = match &self.ca_file {
            Some(path) => Some(read_pem(path, "AMQP CA file", "CERTIFICATE")?),
            None => None,
        };
        let identity = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Some(OwnedIdentity::PKCS8 {
                pem: read_pem(cert, "AMQP client certificate", "CERTIFICATE")?.into_bytes(),
                key: read_pem(key, "AMQP client key", "PRIVATE KEY")?.into_bytes(),
            }),
            (None, None) => None,
            _ => return Err(AmqpTlsError::Incomplete),
        };
        Ok(OwnedTLSConfig {
            identity,
            cert_chain,
        })
    }
}

/// Reads a PEM file and checks it has a block whose label ends with `label`.
fn read_pem(path: &Path, what: &'static str, label: &'static str) -> Result<String, AmqpTlsError> {
    let text = std::fs::read_to_string(path).map_err(|source| AmqpTlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    let has_block = text.lines().any(|l| {
        l.trim()
            .strip_prefix("-----BEGIN ")
            .and_then(|rest| rest.strip_suffix("-----"))
            .is_some_and(|name| name.ends_with(label))
    });
    if !has_block {
        return Err(AmqpTlsError::NotPem {
            what,
            path: path.to_path_buf(),
            expected: label,
        });
    }
    Ok(text)
}
