//! One shutdown signal handed to every task: listeners stop accepting,
//! background loops end, in-flight requests drain up to a deadline.

use tokio::sync::watch;

/// Trigger side, held by whoever decides to stop (signals, tests).
#[derive(Debug, Clone)]
pub struct Trigger(watch::Sender<bool>);

/// Listening side, cloned into every task.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

/// A new signal, not yet triggered.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger(tx), Shutdown(rx))
}

impl Trigger {
    /// Starts shutdown everywhere. Idempotent.
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }
}

impl Shutdown {
    /// Resolves once shutdown was triggered (or its trigger was dropped).
    pub async fn wait(&self) {
        let mut rx = self.0.clone();
        // An error means every trigger is gone: nobody can start the
        // gateway's shutdown any more, so treat it as triggered.
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// True once shutdown was triggered.
    pub fn is_triggered(&self) -> bool {
        *self.0.borrow()
    }
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
pub async fn os_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
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
