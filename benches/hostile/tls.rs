//! TLS: a self-signed certificate made at start, client configs trusting it, and the
//! handshake attack (full handshakes, no resumption, from parallel clients).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::http1::Tally;
use crate::proxy::Session;
use crate::report::Run;
use crate::Ctx;

/// The proxy's certificate and key files, and the clients' configs.
pub struct Material {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// For the probe: HTTP/1.1 by ALPN.
    pub probe: Arc<rustls::ClientConfig>,
    /// For the attackers: no session resumption, so every handshake is a full one.
    pub full: Arc<rustls::ClientConfig>,
}

impl Material {
    /// A certificate for `localhost` and 127.0.0.1, written into `dir`.
    pub fn generate(dir: &Path) -> Material {
        let certified = rcgen::generate_simple_self_signed(vec![
            "localhost".to_string(),
            "127.0.0.1".to_string(),
        ])
        .unwrap();
        let (cert_file, key_file) = (dir.join("proxy.crt"), dir.join("proxy.key"));
        std::fs::write(&cert_file, certified.cert.pem()).unwrap();
        std::fs::write(&key_file, certified.key_pair.serialize_pem()).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(certified.cert.der().clone()).unwrap();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let mut probe = config.clone();
        probe.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut full = config;
        full.resumption = rustls::client::Resumption::disabled();
        Material {
            cert_file,
            key_file,
            probe: Arc::new(probe),
            full: Arc::new(full),
        }
    }
}

/// Full TLS handshakes from parallel clients, each closing right after its handshake.
pub async fn handshakes(ctx: &Ctx, bin: &Path, run: Run) -> Run {
    let extra = format!(
        "[tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        ctx.tls.cert_file.display().to_string(),
        ctx.tls.key_file.display().to_string()
    );
    let mut s = Session::begin(ctx, bin, run, ctx.backends.fast, &extra, true).await;
    let addr = s.proxy.addr;
    let secs = ctx.args.tls_secs;
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let cpu0 = s.proxy.cpu();
    let tasks: Vec<_> = (0..ctx.args.tls_clients)
        .map(|_| {
            let config = ctx.tls.full.clone();
            tokio::spawn(async move {
                let connector = tokio_rustls::TlsConnector::from(config);
                let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
                let mut tally = Tally::default();
                while Instant::now() < deadline {
                    let shake = async {
                        let tcp = TcpStream::connect(addr)
                            .await
                            .map_err(|e| format!("connect: {}", e.kind()))?;
                        let mut tls = connector
                            .connect(name.clone(), tcp)
                            .await
                            .map_err(|e| format!("TLS: {e}"))?;
                        let _ = tls.shutdown().await;
                        Ok::<_, String>("completed")
                    };
                    match tokio::time::timeout(Duration::from_secs(10), shake).await {
                        Ok(Ok(what)) => tally.add(what),
                        Ok(Err(e)) => tally.add(e),
                        Err(_) => tally.add("no handshake in 10 s"),
                    }
                }
                tally
            })
        })
        .collect();
    let mut tally = Tally::default();
    for t in tasks {
        tally.merge(t.await.unwrap());
    }
    let cpu = s.proxy.cpu() - cpu0;
    let done = tally.count("completed") as f64;
    s.run.text("handshakes", tally.text());
    s.run.num("full handshakes per second", done / secs, "/s");
    s.run.num(
        "proxy CPU per 1,000 handshakes",
        1000.0 * cpu / done.max(1.0),
        "s",
    );
    s.run.num(
        "proxy CPU while handshaking, share of a core",
        100.0 * cpu / secs,
        "%",
    );
    s.end().await
}
