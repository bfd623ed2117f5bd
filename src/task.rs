//! Task boundaries: a panic inside a task becomes a value its caller can act on (requeue the
//! requests it held, restart the task), never a silent end of the task.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;
use tokio_util::sync::CancellationToken;
use tracing::error;

use crate::metrics;

/// Runs `fut`, turning a panic into its message (the payload of `panic!` with a message, or
/// "a panic without a message").
pub async fn catch_panic<F: Future>(fut: F) -> Result<F::Output, String> {
    AssertUnwindSafe(fut).catch_unwind().await.map_err(|p| match (p.downcast_ref::<&str>(), p.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_owned(),
        (None, Some(s)) => s.clone(),
        (None, None) => "a panic without a message".to_owned(),
    })
}

/// Runs the task `start` makes until it returns or `stop` fires; after a panic (logged at ERROR
/// naming `what`, counted in `task_panics_total{stage}`) starts it again `wait` later.
pub async fn restart_after_panic<F, Fut>(what: &str, stage: &'static str, wait: Duration, stop: &CancellationToken, mut start: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    while let Err(panic) = catch_panic(start()).await {
        error!(panic = %panic, retry_in = ?wait, "{what} panicked; starting it again");
        metrics::task_panicked(stage);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn catch_panic_returns_the_message() {
        assert_eq!(catch_panic(async { 3 }).await, Ok(3));
        let got = catch_panic(async { panic!("boom {}", 1) }).await;
        assert_eq!(got, Err::<(), _>("boom 1".to_owned()));
        let got = catch_panic(async { std::panic::panic_any(5u8) }).await;
        assert_eq!(got, Err::<(), _>("a panic without a message".to_owned()));
    }

    fn panics(stage: &str) -> f64 {
        let line = format!("prefix_batcher_task_panics_total{{stage=\"{stage}\"}} ");
        metrics::render().lines().find_map(|l| l.strip_prefix(line.as_str())?.parse().ok()).unwrap_or(0.0)
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicked_task_starts_again_after_the_wait_until_it_returns() {
        const STAGE: &str = "test_restart";
        let starts = std::sync::atomic::AtomicU32::new(0);
        let t0 = tokio::time::Instant::now();
        restart_after_panic("the test task", STAGE, Duration::from_secs(1), &CancellationToken::new(), || async {
            if starts.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 2 {
                panic!("not yet");
            }
        })
        .await;
        assert_eq!(starts.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert_eq!(t0.elapsed(), Duration::from_secs(2), "one wait after each of the two panics");
        assert_eq!(panics(STAGE), 2.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_during_the_wait_ends_it() {
        let stop = CancellationToken::new();
        let starts = std::sync::atomic::AtomicU32::new(0);
        let stopper = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            stopper.cancel();
        });
        restart_after_panic("the test task", "test_stop", Duration::from_secs(60), &stop, || async {
            starts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            panic!("always");
        })
        .await;
        assert_eq!(starts.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
