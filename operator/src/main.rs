#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use dropgate_operator::cli::{self, Cli};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs to stderr so that `crdgen`, `apply` and `inject` print clean YAML.
    let telemetry =
        dropgate_telemetry::Telemetry::init("dropgate-operator", "info", cli.log_format);
    let code = cli::run(cli).await;
    telemetry.shutdown().await;
    code
}
