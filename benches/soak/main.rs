//! The chaos soak: the whole event plane as real processes on this machine — etcd,
//! engines feeding `kv_relay`s (our wire and Dynamo's), two routers in their own
//! network namespaces — with faults injected on a seeded schedule, and an oracle that
//! must balance exactly at the end (see `docs/DESIGN.md` §9 and docs/guarantees.md).
//!
//! ```text
//! cargo run --release -p eventplane-benches --bin soak -- --minutes 3 --seed 1 --report soak.json
//! ```
//!
//! Exit 0 only if every invariant held; 1 when one broke (the report names it, the
//! process and publisher, and the seed); 2 on a refused argument or a harness failure.

mod cluster;
mod effects;
mod engine;
mod faults;
mod fidelity;
mod ledger;
mod netns;
mod process;
mod resources;
mod rng;
mod router;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// Command line of the soak and of the processes it starts.
#[derive(Debug, Parser)]
#[command(
    about = "A chaos soak of the event plane: real processes, seeded faults, an exact ledger"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    #[command(flatten)]
    run: cluster::RunArgs,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// An engine stand-in (started by the soak).
    #[command(hide = true)]
    Engine {
        #[arg(long)]
        worker: u64,
        #[arg(long)]
        seed: u64,
        #[arg(long, default_value_t = 100)]
        interval_ms: u64,
        #[arg(long, default_value_t = 256)]
        capacity: usize,
        #[arg(long, default_value_t = 4)]
        block_size: u32,
    },
    /// The soak's router (started by the soak).
    #[command(hide = true)]
    Router {
        #[arg(long)]
        etcd: String,
        #[arg(long)]
        namespace: String,
        #[arg(long, default_value_t = 32)]
        lane_capacity: usize,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start a runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let done = match cli.role {
        Some(Role::Engine {
            worker,
            seed,
            interval_ms,
            capacity,
            block_size,
        }) => rt.block_on(engine::run(engine::EngineArgs {
            worker,
            seed,
            interval: Duration::from_millis(interval_ms.max(1)),
            capacity,
            block_size,
        })),
        Some(Role::Router {
            etcd,
            namespace,
            lane_capacity,
        }) => rt.block_on(async {
            // The router's own logs (RUST_LOG, `warn` unless SOAK_ROUTER_LOG says
            // otherwise: see cluster.rs), on stderr, into its log file.
            use tracing_subscriber::layer::SubscriberExt;
            use tracing_subscriber::util::SubscriberInitExt;
            let filter: tracing_subscriber::filter::Targets = std::env::var("RUST_LOG")
                .ok()
                .and_then(|spec| spec.parse().ok())
                .unwrap_or_else(|| {
                    tracing_subscriber::filter::Targets::new()
                        .with_default(tracing_subscriber::filter::LevelFilter::WARN)
                });
            let _ = tracing_subscriber::registry()
                .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
                .with(filter)
                .try_init();
            router::run(router::RouterArgs {
                etcd,
                namespace,
                lane_capacity,
            })
            .await
        }),
        None => {
            return rt.block_on(run::main(
                cli.run,
                PathBuf::from(env!("CARGO_MANIFEST_DIR")),
            ));
        }
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
    }
}
