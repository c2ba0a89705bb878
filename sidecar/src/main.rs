#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use dropgate_sidecar::Settings;

#[cfg(not(feature = "allocation-count"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

// A build that counts its allocations (the bench's measure): the count is the
// program's, whichever allocator serves it.
#[cfg(feature = "allocation-count")]
#[global_allocator]
static ALLOCATOR: &stats_alloc::StatsAlloc<std::alloc::System> = &stats_alloc::INSTRUMENTED_SYSTEM;

#[tokio::main]
async fn main() -> ExitCode {
    // Huge pages off before the sidecar allocates in earnest: on a host whose
    // transparent huge pages are `always`, mimalloc's eagerly committed arenas made
    // each touched 2 MiB resident, and 10,000 slow connections took the RSS from 43 to
    // 90 MiB, past the injected container's 64 MiB limit (29 -> 62 MiB without).
    #[cfg(target_os = "linux")]
    if let Err(error) = rustix::thread::disable_transparent_huge_pages(true) {
        eprintln!("dropgate-sidecar: could not turn transparent huge pages off: {error}");
    }
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
