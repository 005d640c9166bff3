//! `guide_router`: the router of the crate's guide (`eventplane::guide`, "The router
//! side") as a program. `router.rs` is the code the guide shows, word for word; this
//! file only reads the command line, connects to etcd and prints what was indexed.
//!
//! ```text
//! guide_router --etcd URL --namespace NS [--deliveries N] [--until-block H]
//!              [--timeout-ms MS]
//! ```
//! Follows every `kv-events` publisher of NS registered in etcd (our records; start
//! workers with `kv-relay --etcd URL --namespace NS --component C --worker-id W …`),
//! saying `connected (N connections)` on stderr at each connection. After N
//! deliveries, once a worker holds block H, on timeout, or on Ctrl-C / SIGTERM it
//! prints one JSON line on stdout:
//!
//! ```text
//! {"deliveries":N,"unidentified":U,"undecodable":D,"lost":L,
//!  "workers":[{"worker_id":W,"dp_rank":R,"blocks":[hash,...]},...]}
//! ```
//! (`workers` sorted by id and rank, `blocks` sorted). Exit codes: 0 after N
//! deliveries, block H, or a signal; 1 on timeout (or if the subscriber stops); 2 on
//! bad arguments; 3 when etcd cannot be reached.

use eventplane_cli as common;
// Written as a user copies it, with `pub` items.
#[allow(unreachable_pub)]
mod router;

use std::collections::BTreeSet;
use std::process::ExitCode;

use clap::Parser;
use common::{StartError, optional_timeout, stop_signal};

use eventplane::discovery::Backend;

#[derive(Parser, Debug)]
#[command(
    about = "The guide's KV router: follow every worker of a namespace through etcd, index their blocks",
    after_help = "Output: `connected (N connections)` on stderr at each connection; one JSON \
                  line on stdout at exit: {\"deliveries\", \"unidentified\", \"undecodable\", \
                  \"lost\", \"workers\": [{\"worker_id\", \"dp_rank\", \"blocks\": [...]}]}.\
                  \n\nExit codes: 0 after --deliveries N, --until-block H, or on SIGTERM / \
                  Ctrl-C; 1 on timeout or if the subscriber stops; 2 on bad arguments; 3 when \
                  etcd cannot be reached."
)]
struct Args {
    /// etcd endpoint (http://host:2379); repeat for a cluster.
    #[arg(long, required = true)]
    etcd: Vec<String>,
    /// Namespace whose workers to follow.
    #[arg(long)]
    namespace: String,
    /// Stop after this many deliveries.
    #[arg(long)]
    deliveries: Option<u64>,
    /// Stop once a worker holds this block (a marker a script sends last).
    #[arg(long = "until-block")]
    until_block: Option<u64>,
    /// Stop (exit 1) after this long.
    #[arg(long = "timeout-ms")]
    timeout_ms: Option<u64>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    common::init_tracing();
    let stop = stop_signal();
    let args = Args::parse();
    let discovery = match Backend::etcd(&args.etcd).connect().await {
        Ok(d) => d,
        Err(e) => return StartError::etcd(&e).report(),
    };
    let mut subscriber = match router::subscribe(discovery.discovery().clone(), &args.namespace) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("invalid subscriber settings: {e}");
            return ExitCode::from(2);
        }
    };
    let mut index = router::Index::default();
    let (enough, until) = (args.deliveries, args.until_block);
    let finished = |i: &router::Index| {
        enough.is_some_and(|n| i.deliveries >= n)
            || until.is_some_and(|h| i.holders(h).next().is_some())
    };
    let timeout = optional_timeout(args.timeout_ms);
    tokio::pin!(stop, timeout);
    let code = loop {
        let seen = index.connections;
        tokio::select! {
            () = router::route(&mut subscriber, &mut index, |i| finished(i) || i.connections > seen) => {}
            () = &mut stop => break 0,
            () = &mut timeout => break 1,
        }
        if finished(&index) {
            break 0;
        }
        if index.connections == seen {
            eprintln!("the subscriber stopped");
            break 1;
        }
        eprintln!("connected ({} connections)", index.connections);
    };
    subscriber.handle().shutdown().await;
    discovery.close().await;
    // Per worker and rank, the blocks it holds.
    let held = index.feed.index();
    let workers: Vec<_> = held
        .ranks()
        .map(|(worker, dp_rank)| {
            let blocks: BTreeSet<u64> = held
                .rank_block_hashes(worker, dp_rank)
                .map(|h| h.0)
                .collect();
            serde_json::json!({"worker_id": worker.0, "dp_rank": dp_rank, "blocks": blocks})
        })
        .collect();
    let report = serde_json::json!({
        "deliveries": index.deliveries,
        "unidentified": index.unidentified(),
        "undecodable": index.undecodable(),
        "lost": index.lost(),
        "workers": workers,
    });
    println!("{report}");
    ExitCode::from(code)
}
