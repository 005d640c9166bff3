//! The test API server's TLS and credentials: the tunnel's test certificate
//! (`tests/fixtures/tunnel/bus.pem`, for `DNS:localhost` and `IP:127.0.0.1`, signed by
//! the test CA `ca.pem`), and what a client needs to reach the server: a kubeconfig
//! carrying the CA data and the bearer token, or the in-cluster files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The bearer token a server started with [`KubeApi::start`](super::KubeApi::start)
/// requires.
pub const TOKEN: &str = "eventplane-test-token-0123456789";

/// A file of `tests/fixtures/tunnel/` (`ca.pem`, `other-ca.pem`, `bus.pem`, `bus.key`).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tunnel")
        .join(name)
}

/// The server's TLS configuration (rustls with ring, as the library's clients use):
/// the test certificate; HTTP/1.1 only (the server speaks nothing else).
pub(super) fn server_config() -> Arc<rustls::ServerConfig> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(fixture("bus.pem"))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(fixture("bus.key")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// Standard base64 with padding (a kubeconfig's `certificate-authority-data`).
pub(super) fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A kubeconfig naming `server` (and `namespace`): with `ca` (a PEM file) as its
/// `certificate-authority-data` and `token` as its user's, each when given.
pub(super) fn kubeconfig_text(
    server: &str,
    namespace: &str,
    ca: Option<&Path>,
    token: Option<&str>,
) -> String {
    let ca = ca.map_or_else(String::new, |path| {
        format!(
            "    certificate-authority-data: {}\n",
            base64(&std::fs::read(path).unwrap())
        )
    });
    let user = token.map_or_else(
        || "  user: {}\n".to_owned(),
        |t| format!("  user:\n    token: {t}\n"),
    );
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n{ca}\
         contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n    namespace: {namespace}\n\
         current-context: test\nusers:\n- name: test\n{user}"
    )
}

#[test]
fn base64_is_the_standard_one() {
    assert_eq!(base64(b""), "");
    assert_eq!(base64(b"f"), "Zg==");
    assert_eq!(base64(b"fo"), "Zm8=");
    assert_eq!(base64(b"foo"), "Zm9v");
    assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    assert_eq!(base64(&[0xfb, 0xff]), "+/8=");
}
