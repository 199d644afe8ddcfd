//! The run's settings, read from the environment (each one is documented in `main.rs`).

use std::time::Duration;

pub(crate) struct Settings {
    pub(crate) backends: Vec<String>,
    pub(crate) secs: f64,
    pub(crate) rounds: usize,
    pub(crate) conns: usize,
    pub(crate) trips: usize,
    pub(crate) big: usize,
    pub(crate) soak_secs: f64,
    pub(crate) soak_requests: u64,
    pub(crate) test_before_acquire: bool,
    pub(crate) delay: Duration,
    pub(crate) scale: Option<u64>,
    scale_small: Option<u64>,
    scale_expired: Option<u64>,
    #[cfg(feature = "postgres")]
    pub(crate) database_url: String,
    #[cfg(feature = "mysql")]
    pub(crate) mysql_url: String,
    pub(crate) peer: bool,
    // The peer runs on PostgreSQL only.
    #[cfg(feature = "postgres")]
    pub(crate) peer_store: String,
    #[cfg(feature = "postgres")]
    pub(crate) peer_redis: String,
    #[cfg(feature = "postgres")]
    pub(crate) peer_keying: String,
}

fn env_opt<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    env_opt(name).unwrap_or(default)
}

impl Settings {
    pub(crate) fn from_env() -> Self {
        Self {
            backends: std::env::var("BENCH_BACKENDS")
                .unwrap_or_else(|_| "sqlite,postgres,mysql".into())
                .split(',')
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect(),
            secs: env_or("BENCH_SECS", 1.0),
            rounds: env_or("BENCH_ROUNDS", 15),
            conns: env_or("BENCH_CONNECTIONS", 32),
            trips: env_or("BENCH_TRIPS", 200),
            big: env_or("BENCH_BIG", 256),
            soak_secs: env_or("BENCH_SOAK_SECS", 45.0),
            soak_requests: env_or("BENCH_SOAK_REQUESTS", 1_000_000),
            test_before_acquire: env_or("BENCH_TEST_BEFORE_ACQUIRE", true),
            delay: Duration::from_secs_f64(env_or("BENCH_DELAY_MS", 1.0_f64).max(0.0) / 1000.0),
            scale: env_opt("BENCH_SCALE"),
            scale_small: env_opt("BENCH_SCALE_SMALL"),
            scale_expired: env_opt("BENCH_SCALE_EXPIRED"),
            #[cfg(feature = "postgres")]
            database_url: std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
            #[cfg(feature = "mysql")]
            mysql_url: std::env::var("MYSQL_URL")
                .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into()),
            peer: env_or("BENCH_PEER", true),
            #[cfg(feature = "postgres")]
            peer_store: std::env::var("BENCH_PEER_STORE").unwrap_or_else(|_| "auto".into()),
            #[cfg(feature = "postgres")]
            peer_redis: std::env::var("BENCH_PEER_REDIS")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
            #[cfg(feature = "postgres")]
            peer_keying: std::env::var("BENCH_PEER_KEYING").unwrap_or_else(|_| "header".into()),
        }
    }

    pub(crate) fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.secs)
    }

    /// The records the scale section fills on `backend` and how many of them are expired, or
    /// `None` without `BENCH_SCALE`. SQLite and MariaDB are capped lower by default: a single
    /// writer and a slower bulk insert would make their fill the whole run.
    pub(crate) fn scale_of(&self, backend: &str) -> Option<(u64, u64)> {
        let scale = self.scale?;
        let rows = if backend == "postgres" {
            scale
        } else {
            self.scale_small.unwrap_or(scale.min(1_000_000))
        };
        let expired = self
            .scale_expired
            .unwrap_or((rows / 10).min(1_000_000))
            .min(rows);
        Some((rows, expired))
    }
}

/// Whether `BENCH_ONLY` leaves this scenario (or section) in.
pub(crate) fn wanted(scenario: &str) -> bool {
    std::env::var("BENCH_ONLY").map_or(true, |only| only.split(',').any(|o| o.trim() == scenario))
}
