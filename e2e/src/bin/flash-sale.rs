#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use dropgate_e2e::flash_sale::{self, Options};

/// A local flash sale: redis-server, `dropgate-operator apply`, a sidecar, and
/// thousands of concurrent buyers. Exits non-zero if anything was oversold.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// The InventoryDrop to sell.
    #[arg(short = 'f', long, default_value = "examples/drop.yaml")]
    manifest: PathBuf,
    /// Buyers, each with a key of their own.
    #[arg(long, default_value_t = 5000)]
    buyers: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 1000)]
    concurrency: usize,
    /// Seed of the buyers' choices (sizes, duplicates, cancels).
    #[arg(long, default_value_t = 412)]
    seed: u64,
    /// Buyers check out through carts (`POST /v1/carts`) instead of single reserves.
    #[arg(long)]
    carts: bool,
    /// The drop gets a waitlist: buyers turned away wait in line, and the summary
    /// shows how many returned units went to them and whether the order held.
    #[arg(long)]
    waitlist: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let options = Options {
        manifest: cli.manifest,
        buyers: cli.buyers,
        concurrency: cli.concurrency,
        seed: cli.seed,
        carts: cli.carts,
        waitlist: cli.waitlist,
        ..Options::default()
    };
    match flash_sale::run(&options).await {
        Ok(summary) => {
            println!("{summary}");
            let violations = summary.violations();
            if violations.is_empty() {
                println!("invariants: held");
                ExitCode::SUCCESS
            } else {
                for v in violations {
                    eprintln!("VIOLATED: {v}");
                }
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
