#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use dropgate_sidecar::Settings;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let settings = Settings::parse();
    let telemetry = dropgate_telemetry::Telemetry::init(
        "dropgate-sidecar",
        dropgate_sidecar::DEFAULT_LOG_FILTER,
        settings.log_format,
    );
    if let Err(e) = dropgate_sidecar::faults::arm_from_env() {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    // rediss:// needs a process-wide rustls crypto provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let listener =
        match dropgate_listener::bind(settings.listen, &dropgate_sidecar::server::API_LIMITS) {
            Ok(listener) => listener,
            Err(e) => {
                eprintln!("error: cannot listen on {}: {e}", settings.listen);
                return ExitCode::FAILURE;
            }
        };
    let served = dropgate_sidecar::run(listener, settings, shutdown_signal()).await;
    telemetry.shutdown().await;
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// SIGTERM (Kubernetes stopping the pod) or Ctrl-C.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
