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
//! stops startup with a message naming the key, and so does a client certificate that has already
//! expired by this host's clock. The files are not read again while the daemon runs: the expiry of
//! the client certificate in use is exported as a metric ([`ClientIdentity::expires_at`]).

use std::fmt;
use std::path::Path;
use std::sync::Once;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
    /// When the chain stops being usable: the earliest `notAfter` of its certificates, in Unix
    /// seconds (UTC), read once by [`load`]. `None` when no certificate of the chain parses as
    /// X.509 (rustls has accepted the chain, so that does not happen with real files).
    pub expires_at: Option<i64>,
}

/// The subject and validity period of one certificate of a PEM file. Times in Unix seconds (UTC),
/// from the certificate's `notBefore` and `notAfter` fields (RFC 5280, 4.1.2.5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateDates {
    /// The subject as a distinguished name, e.g. `CN=prefix-batcher, O=example`.
    pub subject: String,
    pub not_before: i64,
    pub not_after: i64,
}

/// The subject and validity of each certificate in `pem`, in file order. Blocks that are not
/// certificates, and certificates that do not parse as X.509, are skipped.
pub fn certificate_dates(pem: &[u8]) -> Vec<CertificateDates> {
    CertificateDer::pem_slice_iter(pem)
        .flatten()
        .filter_map(|der| {
            let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
            let v = cert.validity();
            Some(CertificateDates { subject: cert.subject().to_string(), not_before: v.not_before.timestamp(), not_after: v.not_after.timestamp() })
        })
        .collect()
}

/// From this many seconds before a client certificate expires (14 days), startup warns of it and
/// each instance's health line in `status` notes it.
pub const CLIENT_CERT_WARN_SECS: i64 = 14 * 86_400;

/// A note on the client certificate of `link` that expires at `expires_at` (Unix seconds) when
/// that is less than [`CLIENT_CERT_WARN_SECS`] after `now`: `amqp client certificate expires in
/// 6 days` or `… expired 2 hours ago`; `None` otherwise.
pub fn expiry_note(link: &str, expires_at: i64, now: i64) -> Option<String> {
    let left = expires_at - now;
    if left >= CLIENT_CERT_WARN_SECS {
        return None;
    }
    Some(if left >= 0 {
        format!("{link} client certificate expires in {}", span_text(left))
    } else {
        format!("{link} client certificate expired {} ago", span_text(left))
    })
}

/// A hint for a connection error whose text shows a TLS client talking to a plain port: rustls
/// reads the server's first bytes as a TLS record and finds none ("received corrupt message of
/// type InvalidContentType"). `None` for other errors.
pub fn plain_port_hint(error_text: &str) -> Option<&'static str> {
    error_text.contains("InvalidContentType").then_some(
        "the server did not answer in TLS: is the URL's port its TLS listener (RabbitMQ's amqps port, 5671 by default, not 5672; Redis's tls-port)?",
    )
}

/// The current time in Unix seconds.
pub fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// `unix_seconds` as an RFC 3339 UTC time, e.g. `2027-01-31T12:00:00Z`.
pub fn rfc3339(unix_seconds: i64) -> String {
    match u64::try_from(unix_seconds) {
        Ok(s) => humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(s)).to_string(),
        Err(_) => format!("{unix_seconds} s before 1970"),
    }
}

/// A span of `seconds` (its absolute value) in the largest whole unit that fits: "3 days",
/// "5 hours", "12 minutes", "40 seconds".
pub fn span_text(seconds: i64) -> String {
    let s = seconds.unsigned_abs();
    let (n, unit) = match s {
        86_400.. => (s / 86_400, "day"),
        3_600.. => (s / 3_600, "hour"),
        60.. => (s / 60, "minute"),
        _ => (s, "second"),
    };
    format!("{n} {unit}{}", if n == 1 { "" } else { "s" })
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
/// reverse, a client certificate chain with a certificate past its `notAfter` (the server would
/// refuse it with the TLS alert `certificate_expired`, RFC 8446 6.2) or with a `notBefore` more
/// than 5 minutes ahead (`NOT_BEFORE_SKEW_SECS`) — each naming the key and the
/// path, never the file's contents (a value that looks like PEM text instead of a path is not
/// echoed either). Expired certificates in the CA bundle are allowed: rustls does not check the
/// validity dates of trust anchors.
pub fn load(keys: TlsKeys, ca_file: &str, cert_file: &str, key_file: &str) -> Result<TlsFiles, TlsFileError> {
    load_at(keys, ca_file, cert_file, key_file, unix_now())
}

/// How far in the future a client certificate's `notBefore` may lie (5 minutes) and still be
/// loaded: clocks differ a little between the host that issued it and this one, and the server
/// decides by its own clock. Further ahead is a certificate issued for later, or a wrong clock.
const NOT_BEFORE_SKEW_SECS: i64 = 300;

/// [`load`] with the current time given (Unix seconds).
fn load_at(keys: TlsKeys, ca_file: &str, cert_file: &str, key_file: &str, now: i64) -> Result<TlsFiles, TlsFileError> {
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
            let fits = |chain: Vec<CertificateDer<'static>>| {
                rustls::ClientConfig::builder().with_root_certificates(rustls::RootCertStore::empty()).with_client_auth_cert(chain, key.clone_key())
            };
            if let Err(e) = fits(chain.clone()) {
                // An X.509 v1 certificate (`openssl x509 -req` without extensions makes one):
                // webpki refuses it whatever the key, so "does not fit" would mislead.
                if e.to_string().contains("UnsupportedCertVersion") {
                    return Err(file_error(
                        keys.cert_file,
                        cert_file,
                        "holds an X.509 version 1 certificate, which TLS here (rustls and webpki) refuses: only version 3 is accepted; issue it with extensions, which makes it version 3 (e.g. `openssl x509 -req … -extfile` with `basicConstraints=CA:FALSE`)".to_owned(),
                    ));
                }
                // A chain written in the wrong order (an intermediate first): the key fits a later
                // certificate of the file, and the order is what to fix.
                let fitting = (1..chain.len()).find(|&i| fits(vec![chain[i].clone()]).is_ok());
                return Err(match fitting {
                    Some(i) => file_error(
                        keys.cert_file,
                        cert_file,
                        format!(
                            "starts with a certificate that {} does not fit, while certificate {} of the file does: put the client certificate first, then its intermediates (the order TLS sends them in, RFC 8446 4.4.2)",
                            keys.key_file,
                            i + 1
                        ),
                    ),
                    None => file_error(keys.key_file, key_file, format!("does not fit {} ({e})", keys.cert_file)),
                });
            }
            let dates = certificate_dates(&cert_pem);
            if let Some(c) = dates.iter().find(|c| c.not_after < now) {
                let rule = format!(
                    "holds a certificate that expired at {} ({} ago by this host's clock; subject {}): servers refuse it (TLS alert certificate_expired); renew it",
                    rfc3339(c.not_after),
                    span_text(now - c.not_after),
                    c.subject
                );
                return Err(file_error(keys.cert_file, cert_file, rule));
            }
            if let Some(c) = dates.iter().find(|c| c.not_before > now + NOT_BEFORE_SKEW_SECS) {
                let rule = format!(
                    "holds a certificate that is not valid before {} (in {} by this host's clock; subject {}): servers refuse it (TLS alert bad_certificate) until then; use one that is valid now, or check this host's clock",
                    rfc3339(c.not_before),
                    span_text(c.not_before - now),
                    c.subject
                );
                return Err(file_error(keys.cert_file, cert_file, rule));
            }
            let expires_at = dates.iter().map(|c| c.not_after).min();
            Some(ClientIdentity { cert_pem, key_pem, expires_at })
        }
    };
    Ok(TlsFiles { ca_pem, client })
}

/// A [`TlsFileError`] for `key` = `path`, the value shown as [`shown_value`] shows it.
fn file_error(key: &'static str, path: &str, rule: String) -> TlsFileError {
    TlsFileError { key, value: shown_value(key, path), rule }
}

/// How the value of the TLS file setting `key` appears in an error message: quoted when it can
/// only be a path, else a note, since a file's contents pasted where its path belongs may be a
/// private key. Not shown:
/// - PEM text (`-----`), a line break, or more than 4,096 bytes (Linux's `PATH_MAX`);
/// - a path segment of more than 64 characters all from the base64 alphabets (a key or a
///   certificate without its PEM lines, or a whole PEM file base64-encoded as in a Kubernetes
///   Secret's `data`): file names like that are not written by people;
/// - more than 64 characters all from the standard base64 alphabet (`A–Z a–z 0–9 + / =`, so
///   `/` may cut the text into short segments) that begin as base64 of DER (`MC`…`MI`: a
///   SEQUENCE, as every key and certificate), of PEM text (`LS0tLS1`: `-----`) or of an OpenSSH
///   key (`b3BlbnNzaC1rZXkt`: `openssh-key-`);
/// - for a `*tls_key_file`, anything but an absolute path: a private key's base64 body starts
///   with `M` (DER's SEQUENCE), never with `/`, while a short body could pass for a relative path.
pub fn shown_value(key: &str, path: &str) -> String {
    let pasted = path.contains("-----")
        || path.contains('\n')
        || path.len() > 4096
        || path.split('/').any(|seg| seg.len() > 64 && seg.bytes().all(|b| b.is_ascii_alphanumeric() || b"+=-_".contains(&b)))
        || looks_like_base64(path);
    if pasted {
        "(not a path: it looks like the file's contents; give the path of a file instead)".to_owned()
    } else if key.ends_with("tls_key_file") && !path.starts_with('/') {
        "(not shown: not an absolute path, so it may be the key itself; give the key file's absolute path)".to_owned()
    } else {
        format!("{path:?}")
    }
}

/// See [`shown_value`]: more than 64 characters of the standard base64 alphabet that begin as
/// base64 of DER, of PEM text or of an OpenSSH key. Deterministic: a key's base64 body may hold
/// `/` anywhere, so no rule on segment lengths finds every one.
fn looks_like_base64(text: &str) -> bool {
    let b = text.as_bytes();
    let der = b.len() > 1 && b[0] == b'M' && (b'C'..=b'I').contains(&b[1]);
    text.len() > 64
        && b.iter().all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(b))
        && (der || text.starts_with("LS0tLS1") || text.starts_with("b3BlbnNzaC1rZXkt"))
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
        let t = TlsFiles { ca_pem: Some(b"CA".to_vec()), client: Some(ClientIdentity { cert_pem: vec![1], key_pem: b"SECRET-KEY".to_vec(), expires_at: None }) };
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
        // Observed: a chain file with an intermediate first was reported as a key that does not
        // fit. The key fits the file's second certificate: the message says to reorder.
        let (cert_b, _) = self_signed(&dir, "b2");
        let reversed = write(&dir, "reversed.pem", &(std::fs::read_to_string(&cert_b).unwrap() + &std::fs::read_to_string(&cert_a).unwrap()));
        let e = load(KEYS, "", &reversed, &key_a).unwrap_err();
        assert_eq!(e.key, "redis.tls_cert_file", "{e:?}");
        assert!(e.rule.contains("certificate 2 of the file does: put the client certificate first"), "{e:?}");

        let key_text = std::fs::read_to_string(&key_a).unwrap();
        let body: String = key_text.lines().filter(|l| !l.starts_with("-----")).collect();
        let oneline = write(&dir, "oneline.key", &key_text.replace('\n', ""));
        let e = load(KEYS, "", &cert_a, &oneline).unwrap_err();
        let shown = format!("{} {} {}", e.key, e.value, e.rule);
        assert!(e.key == "redis.tls_key_file" && !shown.contains(&body[..20]), "the key's contents were echoed: {shown}");

        let e = load(KEYS, "", &cert_a, &key_text).unwrap_err();
        assert!(!format!("{e:?}").contains("BEGIN") && !format!("{e:?}").contains(&body[..20]), "{e:?}");
        assert!(e.value.contains("not a path"), "{e:?}");

        // Observed: a version 1 certificate (`openssl x509 -req` without -extfile) was reported
        // as a key that does not fit it; the message now names the version.
        let csr = dir.join("v1.csr");
        let out = std::process::Command::new("openssl").args(["req", "-new", "-subj", "/CN=v1", "-key"]).arg(&key_a).arg("-out").arg(&csr).output().expect("openssl");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v1 = dir.join("v1.pem");
        let out = std::process::Command::new("openssl").args(["x509", "-req", "-days", "1", "-in"]).arg(&csr).arg("-signkey").arg(&key_a).arg("-out").arg(&v1).output().expect("openssl");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let e = load(KEYS, "", &v1.to_string_lossy(), &key_a).unwrap_err();
        assert!(e.key == "redis.tls_cert_file" && e.rule.contains("version 1"), "{e:?}");

        let garbage = write(&dir, "garbage.pem", "-----BEGIN CERTIFICATE-----\nAAAAAAAA\n-----END CERTIFICATE-----\n");
        let e = load(KEYS, &garbage, "", "").unwrap_err();
        assert!(e.key == "redis.tls_ca_file" && e.rule.contains("not a valid trust anchor"), "{e:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A client certificate past its `notAfter` would be refused by every server: startup stops
    /// naming the file and the date. An expired CA certificate is no error (rustls does not check
    /// the dates of trust anchors). The expiry exported as a metric is the chain's `notAfter`.
    #[test]
    fn an_expired_client_certificate_is_refused_and_the_expiry_is_read() {
        let dir = std::env::temp_dir().join(format!("pb-tls-dates-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = self_signed(&dir, "c"); // valid for 1 day from now
        let now = unix_now();
        let files = load_at(KEYS, "", &cert, &key, now).expect("valid now");
        let expires = files.client.as_ref().unwrap().expires_at.expect("the expiry is read");
        assert!((expires - (now + 86_400)).abs() <= 120, "notAfter {expires} is not about a day after {now}");
        let dates = certificate_dates(&std::fs::read(&cert).unwrap());
        assert_eq!(dates.len(), 1);
        assert_eq!(dates[0].subject, "CN=t");
        assert!(dates[0].not_before <= now && dates[0].not_after == expires, "{dates:?}");

        let e = load_at(KEYS, "", &cert, &key, expires + 3 * 86_400 + 5).unwrap_err();
        assert_eq!(e.key, "redis.tls_cert_file");
        assert!(e.value.contains("c.pem"), "{e:?}");
        assert!(e.rule.contains(&format!("expired at {}", rfc3339(expires))) && e.rule.contains("(3 days ago") && e.rule.contains("CN=t"), "{e:?}");
        load_at(KEYS, &cert, "", "", expires + 3 * 86_400).expect("an expired CA certificate is allowed");

        // Not yet valid: beyond the 5 minutes allowed for clock differences, refused.
        let not_before = dates[0].not_before;
        load_at(KEYS, "", &cert, &key, not_before - NOT_BEFORE_SKEW_SECS).expect("within the clock skew allowed");
        let e = load_at(KEYS, "", &cert, &key, not_before - 2 * 86_400).unwrap_err();
        assert_eq!(e.key, "redis.tls_cert_file");
        assert!(e.rule.contains(&format!("not valid before {} (in 2 days", rfc3339(not_before))) && e.rule.contains("CN=t"), "{e:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Observed: a private key's base64 body without its PEM lines, pasted where the key file's
    /// path belongs, was echoed whole in the startup error. Only what can only be a path is shown.
    #[test]
    fn a_pasted_key_without_its_pem_lines_is_never_shown() {
        let dir = std::env::temp_dir().join(format!("pb-tls-paste-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = self_signed(&dir, "p");
        let pem = std::fs::read_to_string(&key).unwrap();
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let line1 = pem.lines().nth(1).unwrap().to_owned();
        // The whole PEM base64-encoded, as a Kubernetes Secret's `data` holds it.
        let whole_b64 = std::process::Command::new("base64").args(["-w", "0"]).arg(&key).output().unwrap().stdout;
        let whole_b64 = String::from_utf8(whole_b64).unwrap();
        for pasted in [body.as_str(), line1.as_str(), &body[..40], whole_b64.as_str()] {
            let e = load(KEYS, "", &cert, pasted).unwrap_err();
            let shown = format!("{} {} {}", e.key, e.value, e.rule);
            assert!(!shown.contains(&pasted[..20]), "the pasted key was shown: {shown}");
            assert!(e.value.starts_with("(not"), "{e:?}");
            // The same text in the certificate's or the CA's setting (public, but it may be a key
            // put in the wrong place) is not shown either when it is long.
            if pasted.len() > 64 {
                let e = load(KEYS, pasted, "", "").unwrap_err();
                assert!(!e.value.contains(&pasted[..20]), "{e:?}");
            }
        }
        // Base64 text cut by its own `/` characters into short segments (observed: a pasted
        // key's body shown in the CA setting's error when no segment was longer than 64).
        let cut: String = body.chars().filter(|c| *c != '/').collect::<Vec<_>>().chunks(20).map(|c| c.iter().collect::<String>()).collect::<Vec<_>>().join("/");
        let e = load(KEYS, &cut, "", "").unwrap_err();
        assert!(!e.value.contains(&cut[..20]), "{e:?}");
        // Paths are shown: absolute ones for the key, relative ones for the others.
        let e = load(KEYS, "", &cert, "/etc/prefix-batcher/tls/missing.key").unwrap_err();
        assert_eq!(e.value, "\"/etc/prefix-batcher/tls/missing.key\"");
        let e = load(KEYS, "tls/missing-ca.pem", "", "").unwrap_err();
        assert_eq!(e.value, "\"tls/missing-ca.pem\"");
        let long = "/etc/prefix-batcher/tls/clients/production-west-2/amqp-client-certificate.pem";
        assert_eq!(load(KEYS, long, "", "").unwrap_err().value, format!("{long:?}"));
        let long = "/etc/ssl/certs/CompanyInternalRootCertificateAuthorityBundle2026/Production";
        assert_eq!(load(KEYS, long, "", "").unwrap_err().value, format!("{long:?}"), "base64 characters only, but a path");
        let long = "MIcompany/certs/CompanyInternalRootCertificateAuthorityBundle2026/Production";
        assert!(load(KEYS, long, "", "").unwrap_err().value.starts_with("(not"), "the price of the rule: a relative path that begins like DER");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_a_certificate_within_14_days_of_its_expiry_gets_a_note() {
        let now = 1_800_000_000;
        assert_eq!(expiry_note("amqp", now + 14 * 86_400, now), None);
        assert_eq!(expiry_note("amqp", now + 14 * 86_400 - 1, now).as_deref(), Some("amqp client certificate expires in 13 days"));
        assert_eq!(expiry_note("redis", now, now).as_deref(), Some("redis client certificate expires in 0 seconds"));
        assert_eq!(expiry_note("llm", now - 7_200, now).as_deref(), Some("llm client certificate expired 2 hours ago"));
    }

    #[test]
    fn a_plain_port_under_tls_gets_a_hint() {
        assert!(plain_port_hint("amqp connect: IO error: received corrupt message of type InvalidContentType").is_some_and(|h| h.contains("5671")));
        assert_eq!(plain_port_hint("amqp connect: IO error: Connection refused (os error 111)"), None);
    }

    #[test]
    fn times_and_spans_are_written_for_people() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_800_000_000), "2027-01-15T08:00:00Z");
        assert_eq!(span_text(59), "59 seconds");
        assert_eq!(span_text(-60), "1 minute");
        assert_eq!(span_text(7_199), "1 hour");
        assert_eq!(span_text(3 * 86_400 + 5), "3 days");
    }
}
