#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use dropgate_operator::cli::{self, Cli};

#[tokio::main]
async fn main() -> ExitCode {
    dropgate_operator::telemetry::init();
    cli::run(Cli::parse()).await
}
