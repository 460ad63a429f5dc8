//! Open-loop replay of a capture (`replay --captures DIR --timing recorded`): every captured
//! request is sent at its recorded start time scaled by `speed`, on absolute deadlines from one
//! anchor, whatever the responses do; how late each send was is reported.

use std::path::PathBuf;
use std::sync::Arc;

use http::Method;
use parking_lot::Mutex;
use tokio::task::JoinSet;
use tokio::time::{Duration, Instant};

use crate::capture::reader;
use crate::capture::CaptureError;
use crate::replay::client::{ClientError, Connector, Response, Target, TargetConnection};
use crate::replay::config::DEFAULT_MAX_RESPONSE_BYTES;
use crate::shutdown::Shutdown;

/// What to replay, where, and how fast.
#[derive(Debug, Clone)]
pub struct OpenLoopOptions {
    /// Base URL of the endpoint (`http://host:port` or `https://…`, optional path prefix);
    /// each request's recorded path and query is appended.
    pub target: String,
    /// The capture directories (several replicas' captures are merged by start time).
    pub captures: Vec<PathBuf>,
    /// 2.0 replays twice as fast as recorded.
    pub speed: f64,
    /// Where `open-loop-report.json` is written.
    pub out_dir: PathBuf,
    /// Only these session keys (all when empty).
    pub sessions: Vec<String>,
}

/// Percentiles of the schedule lag (dispatch time − due time), in ms.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Lag {
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

/// The outcome of one replayed request.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RequestOutcome {
    /// The captured exchange's id.
    pub id: u64,
    /// Its session key.
    pub session: Option<String>,
    /// Method and path.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Due time from the replay's start (ms): recorded offset / speed.
    pub due_ms: f64,
    /// Dispatch time − due time (ms).
    pub lag_ms: f64,
    /// Response status; absent when the request failed or was interrupted.
    pub status: Option<u16>,
    /// Dispatch to the first response byte (ms).
    pub ttfb_ms: Option<f64>,
    /// Dispatch to last response byte (ms).
    pub latency_ms: Option<f64>,
    /// Response body bytes received.
    pub response_bytes: u64,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What `open-loop-report.json` holds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpenLoopReport {
    /// The endpoint.
    pub target: String,
    /// The capture directories.
    pub captures: Vec<PathBuf>,
    /// The speed factor.
    pub speed: f64,
    /// Captured requests scheduled.
    pub scheduled: usize,
    /// Requests sent.
    pub sent: usize,
    /// Responses with a 2xx status.
    pub ok: usize,
    /// Requests that failed, got a non-2xx status or were interrupted.
    pub failed: usize,
    /// The shutdown signal stopped the replay early.
    pub interrupted: bool,
    /// Recorded span of the capture's request starts (s).
    pub recorded_span_s: f64,
    /// Wall time of the replay (s).
    pub wall_s: f64,
    /// Schedule lag over the sent requests.
    pub schedule_lag: Lag,
    /// Segments that end early.
    pub cuts: Vec<reader::Cut>,
    /// One entry per scheduled request, in due order.
    pub requests: Vec<RequestOutcome>,
}

/// Headers never replayed: connection-level ones, ones the client sets, and redacted values.
fn replayable(name: &str, value: &str) -> bool {
    const SKIP: [&str; 12] = [
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "forwarded",
        "proxy-connection",
        "proxy-authorization",
    ];
    !SKIP.contains(&name) && !name.starts_with("x-forwarded-") && !value.starts_with("REDACTED-")
}

struct Planned {
    id: u64,
    session: Option<String>,
    due: Duration,
    method: Method,
    path: String,
    /// The request's bytes as sent: head and body.
    request: Vec<u8>,
}

/// Connections kept alive between sends: at most this many, each idle at most `IDLE_FOR`.
const MAX_IDLE: usize = 64;
const IDLE_FOR: Duration = Duration::from_secs(4);
/// Opening a connection to the target may take this long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Kept-alive connections to the target, shared by the send tasks.
#[derive(Default)]
struct IdleConnections(Mutex<Vec<TargetConnection>>);

impl IdleConnections {
    /// An idle connection the server has not closed, if any.
    fn take(&self) -> Option<TargetConnection> {
        let mut idle = self.0.lock();
        while let Some(mut conn) = idle.pop() {
            if !conn.is_stale(IDLE_FOR) {
                return Some(conn);
            }
        }
        None
    }

    fn put(&self, conn: TargetConnection) {
        let mut idle = self.0.lock();
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
    }
}

/// Sends one request on a kept-alive connection or a new one; a kept-alive connection the
/// server had closed before reading the request is replaced, as the request was not taken.
async fn send(
    connector: &Connector,
    idle: &IdleConnections,
    request: &[u8],
    head_request: bool,
) -> Result<Response, ClientError> {
    loop {
        let kept = idle.take();
        let reused = kept.is_some();
        let mut conn = match kept {
            Some(conn) => conn,
            None => connector.connect().await?,
        };
        let mut issued = None;
        match conn.exchange_as(request, head_request, &mut issued).await {
            Err(ClientError::ClosedWhileIdle) if reused => continue,
            Err(e) => return Err(e),
            Ok(response) => {
                if response.reusable {
                    idle.put(conn);
                }
                return Ok(response);
            }
        }
    }
}

/// Replays the capture open-loop and writes `open-loop-report.json` into `out_dir`.
pub async fn run(
    opts: OpenLoopOptions,
    mut shutdown: Shutdown,
) -> Result<OpenLoopReport, CaptureError> {
    if !(opts.speed.is_finite() && opts.speed > 0.0) {
        return Err(CaptureError::Invalid(format!(
            "--speed: must be a positive number, got {}",
            opts.speed
        )));
    }
    let target =
        Target::parse(&opts.target).map_err(|e| CaptureError::Invalid(format!("target: {e}")))?;
    let connector = Connector::new(
        target,
        None,
        CONNECT_TIMEOUT,
        DEFAULT_MAX_RESPONSE_BYTES as usize,
    )
    .map_err(|e| CaptureError::Invalid(format!("target: {e}")))?;
    let dir = opts.captures.clone();
    let capture = tokio::task::spawn_blocking(move || crate::capture::merge::read_all(&dir))
        .await
        .map_err(|e| CaptureError::Http(format!("capture reader failed: {e}")))??;
    let mut exchanges: Vec<reader::Exchange> = capture
        .exchanges
        .into_iter()
        .filter(|e| e.request_body.is_some())
        .filter(|e| {
            opts.sessions.is_empty()
                || e.record
                    .session
                    .as_ref()
                    .is_some_and(|k| opts.sessions.contains(k))
        })
        .collect();
    exchanges.sort_by_key(|e| (e.record.start_unix_ns, e.record.id));
    let t0 = exchanges.first().map_or(0, |e| e.record.start_unix_ns);
    let span_ns = exchanges.last().map_or(0, |e| e.record.start_unix_ns - t0);
    let mut plan = Vec::with_capacity(exchanges.len());
    for e in exchanges {
        let r = &e.record;
        let cannot = |why: String| {
            CaptureError::Invalid(format!(
                "exchange {}: cannot rebuild the request: {why}",
                r.id
            ))
        };
        let method = Method::from_bytes(r.method.as_bytes())
            .map_err(|_| cannot(format!("method {:?}", r.method)))?;
        if !r.path.starts_with('/') {
            return Err(cannot(format!("path {:?} is not origin-form", r.path)));
        }
        let fields: Vec<(String, String)> = r
            .request
            .headers
            .iter()
            .filter(|(k, v)| replayable(k, v))
            .cloned()
            .collect();
        let body = e.request_body.unwrap_or_default();
        let request = connector
            .request_bytes_as(&method, &r.path, &fields, &body)
            .map_err(cannot)?;
        let offset_ns = (r.start_unix_ns - t0) as f64 / opts.speed;
        plan.push(Planned {
            id: r.id,
            session: r.session.clone(),
            due: Duration::from_nanos(offset_ns as u64),
            method,
            path: r.path.clone(),
            request,
        });
    }

    let idle = Arc::new(IdleConnections::default());
    let mut outcomes: Vec<RequestOutcome> = plan
        .iter()
        .map(|p| RequestOutcome {
            id: p.id,
            session: p.session.clone(),
            method: p.method.to_string(),
            path: p.path.clone(),
            due_ms: p.due.as_secs_f64() * 1e3,
            lag_ms: 0.0,
            status: None,
            ttfb_ms: None,
            latency_ms: None,
            response_bytes: 0,
            error: Some("not sent (interrupted)".into()),
        })
        .collect();
    let scheduled = plan.len();
    let anchor = Instant::now();
    let mut tasks: JoinSet<(usize, RequestOutcome)> = JoinSet::new();
    let mut interrupted = false;
    let mut sent = 0;
    for (i, p) in plan.into_iter().enumerate() {
        let due = anchor + p.due;
        tokio::select! {
            _ = tokio::time::sleep_until(due) => {}
            _ = shutdown.wait() => {
                interrupted = true;
                break;
            }
        }
        let dispatched = Instant::now();
        let mut outcome = outcomes[i].clone();
        outcome.lag_ms = dispatched.saturating_duration_since(due).as_secs_f64() * 1e3;
        outcome.error = None;
        sent += 1;
        let (connector, idle) = (connector.clone(), idle.clone());
        tasks.spawn(async move {
            let since = |t: Instant| t.saturating_duration_since(dispatched).as_secs_f64() * 1e3;
            match send(&connector, &idle, &p.request, p.method == Method::HEAD).await {
                Ok(resp) => {
                    outcome.status = Some(resp.status);
                    outcome.ttfb_ms = Some(since(resp.first_byte));
                    outcome.latency_ms = Some(since(resp.last_byte));
                    outcome.response_bytes = resp.body.len() as u64;
                }
                Err(e) => outcome.error = Some(e.to_string()),
            }
            (i, outcome)
        });
        // Collect finished ones as we go, so the set does not grow with the whole run.
        while let Some(Ok((j, o))) = tasks.try_join_next() {
            outcomes[j] = o;
        }
    }
    if interrupted {
        tasks.abort_all();
    }
    loop {
        tokio::select! {
            next = tasks.join_next() => match next {
                Some(Ok((j, o))) => outcomes[j] = o,
                Some(Err(_)) => {}
                None => break,
            },
            _ = shutdown.wait(), if !interrupted => {
                interrupted = true;
                tasks.abort_all();
            }
        }
    }
    for o in outcomes.iter_mut().take(sent) {
        if o.status.is_none() && o.error.is_none() {
            o.error = Some("interrupted".into());
        }
    }
    let ok = outcomes
        .iter()
        .filter(|o| o.status.is_some_and(|s| (200..300).contains(&s)) && o.error.is_none())
        .count();
    let mut lags: Vec<f64> = outcomes.iter().take(sent).map(|o| o.lag_ms).collect();
    lags.sort_by(f64::total_cmp);
    let pct = |q: f64| -> f64 {
        if lags.is_empty() {
            return 0.0;
        }
        let rank = ((q * lags.len() as f64).ceil() as usize).clamp(1, lags.len());
        lags[rank - 1]
    };
    let report = OpenLoopReport {
        target: opts.target.clone(),
        captures: opts.captures.clone(),
        speed: opts.speed,
        scheduled,
        sent,
        ok,
        failed: scheduled - ok,
        interrupted,
        recorded_span_s: span_ns as f64 / 1e9,
        wall_s: anchor.elapsed().as_secs_f64(),
        schedule_lag: Lag {
            p50_ms: pct(0.5),
            p99_ms: pct(0.99),
            max_ms: lags.last().copied().unwrap_or(0.0),
        },
        cuts: capture.cuts,
        requests: outcomes,
    };
    std::fs::create_dir_all(&opts.out_dir).map_err(|e| CaptureError::io(&opts.out_dir, e))?;
    let path = opts.out_dir.join("open-loop-report.json");
    let json = serde_json::to_vec_pretty(&report).map_err(|e| CaptureError::io(&path, e.into()))?;
    std::fs::write(&path, json).map_err(|e| CaptureError::io(&path, e))?;
    tracing::info!(
        sent = report.sent,
        ok = report.ok,
        lag_p99_ms = report.schedule_lag.p99_ms,
        report = %path.display(),
        "open-loop replay done"
    );
    Ok(report)
}
