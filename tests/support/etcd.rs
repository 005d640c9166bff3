//! A real `etcd` for tests: started on free loopback ports with a private data dir,
//! waited for until healthy, stopped by PID. Plus a TCP proxy that can cut a client
//! off from it.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// How long etcd may take to become healthy.
const STARTUP: Duration = Duration::from_secs(30);

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A private etcd server. Killed (and its data removed) on drop.
pub struct EtcdServer {
    child: Option<Child>,
    data_dir: PathBuf,
    client_port: u16,
    peer_port: u16,
}

/// Fails the test with how to get etcd when it is missing.
pub fn require_etcd() {
    let found = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "these tests need a real `etcd` on PATH: on Debian `apt-get install -y etcd-server \
         etcd-client` (`.ci/run` does this)"
    );
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl EtcdServer {
    /// Starts a fresh single-member etcd and waits until it is healthy.
    pub async fn start() -> EtcdServer {
        require_etcd();
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let data_dir = base.join(format!(
            "eventplane-etcd-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&data_dir);
        // Ports are picked free and handed to etcd; a rare clash with another process
        // shows up as a failed start, which is retried with new ports.
        for _ in 0..5 {
            let mut server = EtcdServer {
                child: None,
                data_dir: data_dir.clone(),
                client_port: free_port(),
                peer_port: free_port(),
            };
            if server.spawn_and_wait().await {
                return server;
            }
            server.kill();
            let _ = std::fs::remove_dir_all(&data_dir);
        }
        panic!("etcd did not become healthy (see its log above)");
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.client_port))
    }

    async fn spawn_and_wait(&mut self) -> bool {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new("etcd")
            .arg("--name")
            .arg("test")
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("test={peer}"))
            .arg("--logger=zap")
            .arg("--log-level=error")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
        let deadline = Instant::now() + STARTUP;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(_)) = child.try_wait() {
                    return false; // exited: most likely a port clash
                }
            }
            if self.healthy().await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// etcd's own health endpoint says it can serve (it has a leader).
    pub async fn healthy(&self) -> bool {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let probe = async {
            let mut s = tokio::net::TcpStream::connect(self.addr()).await.ok()?;
            let req = format!(
                "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
                self.client_port
            );
            s.write_all(req.as_bytes()).await.ok()?;
            let mut body = Vec::new();
            s.read_to_end(&mut body).await.ok()?;
            Some(String::from_utf8_lossy(&body).contains("\"health\":\"true\""))
        };
        tokio::time::timeout(Duration::from_secs(2), probe)
            .await
            .ok()
            .flatten()
            .unwrap_or(false)
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills etcd (SIGKILL, as a crash) and waits for the process to exit.
    pub fn stop(&mut self) {
        self.kill();
    }

    /// Starts etcd again on the same ports and data. Clients keep the port, so it
    /// cannot change; if another process took it meanwhile (or the kernel has not let
    /// it go yet), the start is retried until that clears.
    pub async fn restart(&mut self) {
        self.kill();
        for attempt in 1..=10 {
            if self.spawn_and_wait().await {
                return;
            }
            self.kill();
            eprintln!("etcd restart attempt {attempt} failed; retrying on the same ports");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!(
            "etcd did not come back on ports {}/{}",
            self.client_port, self.peer_port
        );
    }

    /// Runs `etcdctl` against this server; returns its stdout.
    pub fn etcdctl(&self, args: &[&str]) -> String {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg("--endpoints")
            .arg(self.url())
            .args(args)
            .output()
            .expect("etcdctl (Debian: etcd-client) must be on PATH");
        assert!(
            out.status.success(),
            "etcdctl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// The current store revision.
    pub fn revision(&self) -> i64 {
        let out = self.etcdctl(&["endpoint", "status", "-w", "json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v[0]["Status"]["header"]["revision"].as_i64().unwrap()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

/// A TCP proxy in front of a server that can cut every connection through it and
/// refuse new ones until restored: a network partition for one client. Or, as a black
/// hole, accept new connections and never answer on them: a peer that hangs.
pub struct Proxy {
    addr: SocketAddr,
    up: Arc<AtomicBool>,
    blackhole: Arc<AtomicBool>,
    /// Connections the black hole accepted.
    held: Arc<AtomicU64>,
    /// Cancelled (and replaced) by `restore`: closes the black hole's connections.
    holes: Arc<std::sync::Mutex<CancellationToken>>,
    generation: Arc<tokio::sync::Mutex<CancellationToken>>,
    stop: CancellationToken,
}

impl Proxy {
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(AtomicBool::new(true));
        let blackhole = Arc::new(AtomicBool::new(false));
        let held = Arc::new(AtomicU64::new(0));
        let holes = Arc::new(std::sync::Mutex::new(CancellationToken::new()));
        let generation = Arc::new(tokio::sync::Mutex::new(CancellationToken::new()));
        let stop = CancellationToken::new();
        let (up2, gen2, stop2) = (up.clone(), generation.clone(), stop.clone());
        let (blackhole2, held2, holes2) = (blackhole.clone(), held.clone(), holes.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stop2.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((mut inbound, _)) = accepted else {
                    continue;
                };
                if blackhole2.load(Ordering::SeqCst) {
                    // Read and discard: the client's writes go through, nothing answers.
                    held2.fetch_add(1, Ordering::SeqCst);
                    let hole = holes2.lock().unwrap().clone();
                    let stopped = stop2.clone();
                    tokio::spawn(async move {
                        let mut sink = tokio::io::sink();
                        tokio::select! {
                            () = hole.cancelled() => {}
                            () = stopped.cancelled() => {}
                            _ = tokio::io::copy(&mut inbound, &mut sink) => {}
                        }
                    });
                    continue;
                }
                if !up2.load(Ordering::SeqCst) {
                    drop(inbound); // refused while cut
                    continue;
                }
                let cut = gen2.lock().await.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        () = cut.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    }
                });
            }
        });
        Proxy {
            addr,
            up,
            blackhole,
            held,
            holes,
            generation,
            stop,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Drops every connection through the proxy and refuses new ones.
    pub async fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        let mut generation = self.generation.lock().await;
        generation.cancel();
        *generation = CancellationToken::new();
    }

    /// Drops every connection through the proxy; new ones are accepted but never
    /// answered (requests on them wait for their timeouts) until restored.
    pub async fn blackhole(&self) {
        self.blackhole.store(true, Ordering::SeqCst);
        self.cut().await;
    }

    /// How many connections the black hole accepted so far.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// Accepts (and forwards) connections again; closes the black hole's.
    pub fn restore(&self) {
        self.blackhole.store(false, Ordering::SeqCst);
        let mut holes = self.holes.lock().unwrap();
        holes.cancel();
        *holes = CancellationToken::new();
        drop(holes);
        self.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
