#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The dropgate operator: keeps Redis in line with each InventoryDrop.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Reconcile one manifest against Redis, outside Kubernetes, and print the status.
    Apply {
        /// The InventoryDrop manifest.
        #[arg(short = 'f', long = "filename", value_name = "FILE")]
        file: PathBuf,
        /// Overrides spec.redis.url.
        #[arg(long, env = "DROPGATE_REDIS_URL")]
        redis_url: Option<String>,
    },
    /// Print the InventoryDrop CustomResourceDefinition as YAML.
    Crdgen,
}

#[tokio::main]
async fn main() -> ExitCode {
    dropgate_operator::telemetry::init();
    let cli = Cli::parse();
    match cli.command {
        Command::Crdgen => match dropgate_operator::crd_yaml() {
            Ok(yaml) => {
                print!("{yaml}");
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Command::Apply { file, redis_url } => {
            let manifest = match std::fs::read_to_string(&file) {
                Ok(text) => text,
                Err(e) => return fail(&format!("cannot read {}: {e}", file.display())),
            };
            match dropgate_operator::apply::apply(&manifest, redis_url.as_deref()).await {
                Ok(done) => {
                    match serde_norway::to_string(&done.status) {
                        Ok(yaml) => print!("{yaml}"),
                        Err(e) => return fail(&e),
                    }
                    match done.not_ready {
                        None => ExitCode::SUCCESS,
                        Some(reason) => fail(&format!("not ready: {reason}")),
                    }
                }
                Err(e) => fail(&e),
            }
        }
    }
}

fn fail(reason: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("error: {reason}");
    ExitCode::FAILURE
}
