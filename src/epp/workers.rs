//! The gRPC worker threads: each serves its share of the gateway's connections on its own
//! single-threaded runtime, so a stream's messages, its placement and its replies never wait
//! for a wake-up from another thread (on a multi-threaded runtime, the connection's task and
//! each stream's task ran on either core and woke each other across them on every message).

use std::io;

use futures_util::Stream;
use tokio::sync::{oneshot, watch};
use tonic::service::Routes;

use super::listener::Conn;
use crate::proxy::listener::spawn_worker_thread;
use crate::shutdown::Shutdown;

/// The worker threads serving the picker's connections.
pub(crate) struct Workers {
    done: Vec<oneshot::Receiver<()>>,
    /// Set when the shutdown grace is over: the workers drop their streams.
    cut: watch::Sender<bool>,
}

impl Workers {
    /// Starts one thread per stream of connections, each serving `routes` on what its stream
    /// hands it until `shutdown`.
    pub(crate) fn start<S>(conns: Vec<S>, routes: Routes, shutdown: Shutdown) -> Self
    where
        S: Stream<Item = io::Result<Conn>> + Send + 'static,
    {
        let (cut, cut_rx) = watch::channel(false);
        let mut done = Vec::new();
        for (worker, conns) in conns.into_iter().enumerate() {
            let (routes, mut shutdown, mut cut_rx) =
                (routes.clone(), shutdown.clone(), cut_rx.clone());
            let spawned =
                spawn_worker_thread(format!("agentrace-epp-{worker}"), move || async move {
                    let serve = tonic::transport::Server::builder()
                        .add_routes(routes)
                        .serve_with_incoming_shutdown(conns, async move { shutdown.wait().await });
                    tokio::select! {
                        result = serve => if let Err(e) = result {
                            tracing::error!(error = %e, "epp gRPC server failed");
                        },
                        _ = cut_rx.wait_for(|cut| *cut) => {}
                    }
                    // Returning drops the runtime, and with it whatever streams are still open.
                });
            match spawned {
                Ok(finished_rx) => done.push(finished_rx),
                Err(e) => tracing::error!(error = %e, "cannot start an epp worker thread"),
            }
        }
        Self { done, cut }
    }

    /// Resolves once every worker has stopped, closing the streams still open after `grace`.
    pub(crate) async fn join(self, grace: std::time::Duration) {
        let all = futures_util::future::join_all(self.done);
        tokio::pin!(all);
        if tokio::time::timeout(grace, &mut all).await.is_err() {
            tracing::warn!("epp streams still open after the shutdown grace: closing them");
            self.cut.send_replace(true);
            all.await;
        }
    }
}
