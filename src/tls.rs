//! TLS for the three links — AMQP (`amqps://`), Redis (`rediss://`) and the LLM servers
//! (`https://`) — with one stack: rustls and its ring crypto provider, installed as the process
//! default ([`install_crypto_provider`]) and used by lapin, the redis crate and reqwest alike.
//!
//! Each link takes, in its own section of the configuration (`amqp.`, `redis.`, `llm.`):
//! - `tls_ca_file`: a PEM bundle of CA certificates to verify the server with. Without it, the
//!   system roots. With it: Redis and the LLM servers trust exactly that bundle; AMQP trusts it in
//!   addition to the system roots (lapin adds it to them).
//! - `tls_cert_file` + `tls_key_file`: a PEM client certificate (chain) and its PEM private key
//!   (PKCS#8, PKCS#1 or SEC1), for mutual TLS. Both or neither.
//!
//! Server certificates are always verified, host name included; there is no option to turn that
//! off. The files are read and parsed when the configuration is loaded, so a missing or broken file
//! stops startup with a message naming the key.

use std::fmt;
use std::path::Path;
use std::sync::Once;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Installs rustls' ring provider as the process-wide default, once; every TLS client of the
/// daemon builds on it. Safe to call any number of times, from any thread.
pub fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err: another provider was installed first (by an embedding program); it is used then.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The TLS files of one link, read and checked. Empty (the default) when the link uses the
/// system roots and no client certificate. `Debug` never prints the private key.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM CA bundle (`tls_ca_file`), if configured.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM client certificate chain and PEM private key (`tls_cert_file`, `tls_key_file`).
    pub client: Option<ClientIdentity>,
}

/// A client certificate chain and its private key, both PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsFiles")
            .field("ca_pem", &self.ca_pem.as_ref().map(|p| format!("{} bytes", p.len())))
            .field("client", &self.client.as_ref().map(|_| "certificate and key (key not shown)"))
            .finish()
    }
}

impl TlsFiles {
    /// Whether anything is configured.
    pub fn is_set(&self) -> bool {
        self.ca_pem.is_some() || self.client.is_some()
    }
}

/// A TLS file setting that breaks a rule: the key (e.g. `redis.tls_ca_file`), the value as
/// written, the rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFileError {
    pub key: &'static str,
    pub value: String,
    pub rule: String,
}

/// The configuration keys of one link's TLS files.
#[derive(Debug, Clone, Copy)]
pub struct TlsKeys {
    pub ca_file: &'static str,
    pub cert_file: &'static str,
    pub key_file: &'static str,
}

/// Reads and checks the TLS files of one link (`keys` names its settings): `ca_file` must hold
/// PEM certificates that parse as trust anchors, `cert_file` at least one PEM certificate and
/// `key_file` one unencrypted PEM private key that matches it (checked by building the rustls
/// client configuration the links will use); `cert_file` and `key_file` go together. Empty
/// strings mean "not set".
///
/// Errors: an unreadable file, a file without the expected PEM blocks, certificates that do not
/// parse, a key that does not match its certificate, a certificate without its key or the
/// reverse — each naming the key and the path, never the file's contents (a value that looks like
/// PEM text instead of a path is not echoed either).
pub fn load(keys: TlsKeys, ca_file: &str, cert_file: &str, key_file: &str) -> Result<TlsFiles, TlsFileError> {
    let ca_pem = if ca_file.is_empty() { None } else { Some(certificates(keys.ca_file, ca_file)?.0) };
    if let Some(pem) = &ca_pem {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem).flatten() {
            roots.add(cert).map_err(|e| file_error(keys.ca_file, ca_file, format!("holds a certificate that is not a valid trust anchor ({e})")))?;
        }
    }
    let client = match (cert_file.is_empty(), key_file.is_empty()) {
        (true, true) => None,
        (false, true) => return Err(file_error(keys.key_file, key_file, format!("must be set with {}", keys.cert_file))),
        (true, false) => return Err(file_error(keys.cert_file, cert_file, format!("must be set with {}", keys.key_file))),
        (false, false) => {
            let (cert_pem, chain) = certificates(keys.cert_file, cert_file)?;
            let key_pem = read(keys.key_file, key_file)?;
            let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| {
                let encrypted = String::from_utf8_lossy(&key_pem).contains("ENCRYPTED");
                let rule = if encrypted {
                    "holds an encrypted private key; decrypt it (e.g. `openssl pkey -in KEY -out KEY.plain`) and protect the file by its permissions"
                } else {
                    "holds no PEM private key (PKCS#8 `BEGIN PRIVATE KEY`, PKCS#1 `BEGIN RSA PRIVATE KEY` or SEC1 `BEGIN EC PRIVATE KEY`, one block with its line breaks)"
                };
                file_error(keys.key_file, key_file, rule.to_owned())
            })?;
            install_crypto_provider();
            rustls::ClientConfig::builder()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_client_auth_cert(chain, key)
                .map_err(|e| file_error(keys.key_file, key_file, format!("does not fit {} ({e})", keys.cert_file)))?;
            Some(ClientIdentity { cert_pem, key_pem })
        }
    };
    Ok(TlsFiles { ca_pem, client })
}

/// A [`TlsFileError`] for `key` = `path`. A "path" that looks like PEM text (contents pasted
/// where the path belongs) is not echoed: it may be a private key.
fn file_error(key: &'static str, path: &str, rule: String) -> TlsFileError {
    let value = if path.contains("-----") || path.contains('\n') || path.len() > 4096 {
        "(not a path: it looks like the file's contents; give the path of a file instead)".to_owned()
    } else {
        format!("{path:?}")
    };
    TlsFileError { key, value, rule }
}

fn read(key: &'static str, path: &str) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(Path::new(path)).map_err(|e| file_error(key, path, format!("cannot be read: {e}")))
}

/// The PEM text of a certificate file and its certificates; at least one.
fn certificates(key: &'static str, path: &str) -> Result<(Vec<u8>, Vec<CertificateDer<'static>>), TlsFileError> {
    let pem = read(key, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| file_error(key, path, "is not a PEM certificate file (each block between BEGIN/END CERTIFICATE lines, with its line breaks)".into()))?;
    if certs.is_empty() {
        return Err(file_error(key, path, "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into()));
    }
    Ok((pem, certs))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: TlsKeys = TlsKeys { ca_file: "redis.tls_ca_file", cert_file: "redis.tls_cert_file", key_file: "redis.tls_key_file" };

    fn write(dir: &Path, name: &str, text: &str) -> String {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_string_lossy().into_owned()
    }

    #[test]
    fn unset_files_are_empty_and_bad_ones_name_the_key_and_path() {
        assert_eq!(load(KEYS, "", "", ""), Ok(TlsFiles::default()));
        let dir = std::env::temp_dir().join(format!("pb-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem").to_string_lossy().into_owned();
        let e = load(KEYS, &missing, "", "").unwrap_err();
        assert_eq!(e.key, "redis.tls_ca_file");
        assert!(e.value.contains("missing.pem") && e.rule.contains("cannot be read"), "{e:?}");
        let not_pem = write(&dir, "not.pem", "hello\n");
        let e = load(KEYS, &not_pem, "", "").unwrap_err();
        assert!(e.key == "redis.tls_ca_file" && e.rule.contains("no PEM certificate"), "{e:?}");
        let e = load(KEYS, "", &not_pem, "").unwrap_err();
        assert_eq!(e.key, "redis.tls_key_file", "a certificate without its key");
        let e = load(KEYS, "", "", &not_pem).unwrap_err();
        assert_eq!(e.key, "redis.tls_cert_file", "a key without its certificate");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn debug_never_shows_the_key() {
        let t = TlsFiles { ca_pem: Some(b"CA".to_vec()), client: Some(ClientIdentity { cert_pem: vec![1], key_pem: b"SECRET-KEY".to_vec() }) };
        let shown = format!("{t:?}");
        assert!(!shown.contains("SECRET") && shown.contains("key not shown"), "{shown}");
    }

    /// A self-signed certificate and its key, generated with the openssl command line into `dir`.
    fn self_signed(dir: &Path, name: &str) -> (String, String) {
        let (cert, key) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        let out = std::process::Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1", "-subj", "/CN=t"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("openssl (installed by scripts/services)");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (cert.to_string_lossy().into_owned(), key.to_string_lossy().into_owned())
    }

    #[test]
    fn keys_are_checked_against_their_certificate_and_never_echoed() {
        let dir = std::env::temp_dir().join(format!("pb-tls-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert_a, key_a) = self_signed(&dir, "a");
        let (_, key_b) = self_signed(&dir, "b");
        let ok = load(KEYS, &cert_a, &cert_a, &key_a).expect("a matching pair");
        assert!(ok.ca_pem.is_some() && ok.client.is_some());

        let e = load(KEYS, "", &cert_a, &key_b).unwrap_err();
        assert!(e.key == "redis.tls_key_file" && e.rule.contains("does not fit"), "{e:?}");

        let key_text = std::fs::read_to_string(&key_a).unwrap();
        let body: String = key_text.lines().filter(|l| !l.starts_with("-----")).collect();
        let oneline = write(&dir, "oneline.key", &key_text.replace('\n', ""));
        let e = load(KEYS, "", &cert_a, &oneline).unwrap_err();
        let shown = format!("{} {} {}", e.key, e.value, e.rule);
        assert!(e.key == "redis.tls_key_file" && !shown.contains(&body[..20]), "the key's contents were echoed: {shown}");

        let e = load(KEYS, "", &cert_a, &key_text).unwrap_err();
        assert!(!format!("{e:?}").contains("BEGIN") && !format!("{e:?}").contains(&body[..20]), "{e:?}");
        assert!(e.value.contains("not a path"), "{e:?}");

        let garbage = write(&dir, "garbage.pem", "-----BEGIN CERTIFICATE-----\nAAAAAAAA\n-----END CERTIFICATE-----\n");
        let e = load(KEYS, &garbage, "", "").unwrap_err();
        assert!(e.key == "redis.tls_ca_file" && e.rule.contains("not a valid trust anchor"), "{e:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

}
