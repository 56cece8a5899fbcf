//! Logs, metrics and the health endpoints.
//!
//! Logs go through `tracing`: human-readable by default, one JSON object per line with
//! `LOG_FORMAT=json`; `RUST_LOG` filters. Metrics go through the `metrics` facade into one
//! Prometheus recorder per process, rendered by our own axum route (no TLS stack pulled in).

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Buckets (seconds) for every latency histogram: sub-millisecond to a minute.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];
/// Buckets for batch-size histograms.
pub const SIZE_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
];

/// Installs the global tracing subscriber once; later calls are no-ops (tests run many components
/// in one process). OTLP trace export is on when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
pub fn init_logging() {
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|e| !e.trim().is_empty());
    let program = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "outbox".into());
    init_service(&program, endpoint.as_deref());
}

/// Installs logging for a binary whose service name is `default_service` unless
/// `OTEL_SERVICE_NAME` says otherwise, with OTLP export of spans to `otlp_endpoint` when set.
pub fn init_service(default_service: &str, otlp_endpoint: Option<&str>) {
    let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| default_service.into());
    init(&service, otlp_endpoint);
}

/// Runs a binary's service, giving it a token cancelled on SIGTERM/SIGINT, then flushes the
/// traces: what every long-running command does.
pub async fn run_until_signal<T, F>(service: impl FnOnce(CancellationToken) -> F) -> T
where
    F: std::future::Future<Output = T>,
{
    let shutdown = crate::shutdown::on_signal();
    let result = service(shutdown).await;
    shutdown_tracing();
    result
}

static OTLP: OnceLock<Option<opentelemetry_sdk::trace::SdkTracerProvider>> = OnceLock::new();

/// Whether spans are exported over OTLP.
pub fn otlp_enabled() -> bool {
    OTLP.get().is_some_and(Option::is_some)
}

/// Installs logging (and OTLP export of spans to `otlp_endpoint`, e.g. `http://collector:4318`).
pub fn init(service: &str, otlp_endpoint: Option<&str>) {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let provider = OTLP.get_or_init(|| otlp_endpoint.and_then(|e| otlp_provider(service, e)));
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let json = std::env::var("LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let fmt = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .boxed()
    };
    let otel = provider.as_ref().map(|p| {
        use opentelemetry::trace::TracerProvider;
        tracing_opentelemetry::layer().with_tracer(p.tracer(service.to_string()))
    });
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init();
}

fn otlp_provider(
    service: &str,
    endpoint: &str,
) -> Option<opentelemetry_sdk::trace::SdkTracerProvider> {
    use opentelemetry_otlp::WithExportConfig;
    let url = if endpoint.trim_end_matches('/').ends_with("/v1/traces") {
        endpoint.to_string()
    } else {
        format!("{}/v1/traces", endpoint.trim_end_matches('/'))
    };
    let service = service.to_string();
    // The blocking HTTP client must not be built inside the async runtime.
    std::thread::spawn(move || {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url)
            .with_timeout(Duration::from_secs(5))
            .build();
        match exporter {
            Ok(exporter) => Some(
                opentelemetry_sdk::trace::SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(
                        opentelemetry_sdk::Resource::builder()
                            .with_service_name(service)
                            .build(),
                    )
                    .build(),
            ),
            Err(e) => {
                eprintln!("OTLP export disabled: {e}");
                None
            }
        }
    })
    .join()
    .ok()
    .flatten()
}

/// Flushes and stops OTLP export (call before exiting). A no-op when export is off.
pub fn shutdown_tracing() {
    if let Some(Some(p)) = OTLP.get() {
        let p = p.clone();
        // Flushing uses the blocking client: keep it off the async runtime.
        let _ = std::thread::spawn(move || {
            let _ = p.force_flush();
            let _ = p.shutdown();
        })
        .join();
    }
}

/// The process-wide Prometheus recorder, installed on first use.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Suffix("batch_size".into()), SIZE_BUCKETS)
                })
                .expect("static buckets are valid");
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (embedding service): keep rendering ours.
            let _ = metrics::set_global_recorder(recorder);
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(Duration::from_secs(5));
                        upkeep.run_upkeep();
                    }
                })
                .expect("spawn metrics upkeep thread");
            handle
        })
        .clone()
}

/// What `/readyz` reports: each dependency's last known state, set by the component.
#[derive(Debug, Default)]
pub struct Readiness {
    postgres: AtomicBool,
    rabbitmq: AtomicBool,
    /// Components that do not use RabbitMQ (the producer API) set this to skip it.
    rabbitmq_not_needed: AtomicBool,
}

impl Readiness {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
    pub fn without_rabbitmq() -> Arc<Self> {
        let r = Self::default();
        r.rabbitmq_not_needed.store(true, Ordering::Relaxed);
        Arc::new(r)
    }
    pub fn set_postgres(&self, up: bool) {
        self.postgres.store(up, Ordering::Relaxed);
    }
    pub fn set_rabbitmq(&self, up: bool) {
        self.rabbitmq.store(up, Ordering::Relaxed);
    }
    pub fn postgres(&self) -> bool {
        self.postgres.load(Ordering::Relaxed)
    }
    pub fn rabbitmq(&self) -> bool {
        self.rabbitmq_not_needed.load(Ordering::Relaxed) || self.rabbitmq.load(Ordering::Relaxed)
    }
    pub fn ready(&self) -> bool {
        self.postgres() && self.rabbitmq()
    }
}

#[derive(Clone)]
struct OpsState {
    handle: PrometheusHandle,
    readiness: Arc<Readiness>,
}

/// The `/metrics`, `/healthz`, `/readyz` routes, to serve alone or merge into a service's router.
pub fn ops_router(readiness: Arc<Readiness>) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .with_state(OpsState {
            handle: metrics_handle(),
            readiness,
        })
}

async fn render_metrics(State(s): State<OpsState>) -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        s.handle.render(),
    )
}

async fn ready(State(s): State<OpsState>) -> impl IntoResponse {
    let body = serde_json::json!({
        "postgres": s.readiness.postgres(),
        "rabbitmq": s.readiness.rabbitmq(),
    })
    .to_string();
    let status = if s.readiness.ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
}

/// Binds `addr` and serves the ops routes until `shutdown`. Returns the bound address (port 0 works).
pub async fn serve_ops(
    addr: SocketAddr,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = ops_router(readiness);
    tokio::spawn(async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "metrics server failed");
        }
    });
    tracing::info!(%local, "serving /metrics, /healthz, /readyz");
    Ok(local)
}

/// Here too, where the binaries have always found it.
pub use crate::error::ErrorChain;
