//! SQL injection through a principal id, a route or a body is impossible.
//!
//! Hostile values (quotes, comment markers, backslashes, NUL, dollar quoting, literal syntax of
//! every backend, unicode, invalid UTF-8) go through the whole HTTP layer into each real
//! database. Each must come back byte for byte (from the records table read directly, and as
//! the replay; NUL in a principal, method or route reads back as U+FFFD, as documented), run the business once, share no key with a neighbour that differs from it only
//! in the hostile part, and leave a `canary` table made beforehand as it was.
//!
//! The PostgreSQL and MySQL stores write a record's values into the statement text itself (as
//! hexadecimal) when its response fits in 64 KiB, and bind them past that; the responses here
//! straddle that limit, and the statements sqlx logs show which way each one went.

#![cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]

mod common;

macro_rules! injection {
    ($($backend:ident: $db:ty, $feature:literal { $($only_here:tt)* })*) => {$(
        #[cfg(feature = $feature)]
        mod $backend {
            type Db = $db;
            injection!(@tests []
                hostile_principals_round_trip_and_never_share_a_key,
                hostile_route_templates_and_path_segments_round_trip,
                hostile_bodies_round_trip_byte_for_byte,
                responses_either_side_of_the_literal_limit_round_trip,
                hostile_job_scopes_round_trip,
                nul_in_principal_method_and_route_round_trips,
            );
            $($only_here)*
        }
    )*};
    (@tests $attributes:tt $($test:ident),* $(,)?) => {$(
        injection!(@test $attributes $test);
    )*};
    (@test [$($attribute:meta)?] $test:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        $(#[$attribute])?
        async fn $test() {
            crate::suite::$test::<Db>().await
        }
    };
}

injection! {
    sqlite: sqlx::Sqlite, "sqlite" {}
    postgres: sqlx::Postgres, "postgres" {}
    mysql: sqlx::MySql, "mysql" {}
}

/// What the tests read back from a backend's tables, and what they know of its store.
mod probe {
    use std::future::Future;

    use sqlx::{Pool, Row};

    use crate::common::Db;

    /// A record's columns as the database holds them.
    #[derive(Debug, PartialEq, Eq)]
    pub(crate) struct Stored {
        pub(crate) principal: Option<String>,
        pub(crate) method: String,
        pub(crate) route: String,
        pub(crate) state: String,
        pub(crate) status: Option<i32>,
        pub(crate) headers: Option<Vec<u8>>,
        pub(crate) body: Option<Vec<u8>>,
    }

    pub(crate) const CANARY_NOTE: &str = "still here";

    pub(crate) trait Probe: Db {
        /// Whether this backend's store writes a finished response of up to 64 KiB into the
        /// statement's text. Only asserted when true: a backend that binds is never wrong.
        const LITERAL_FINISH: bool;

        fn stored<'a>(
            pool: &'a Pool<Self>,
            digest: &'a [u8; 32],
        ) -> impl Future<Output = Option<Stored>> + Send + 'a;

        fn create_canary(pool: &Pool<Self>) -> impl Future<Output = ()> + Send + '_;

        /// The canary's rows, which every test expects to be `[(1, CANARY_NOTE)]`.
        fn canary(pool: &Pool<Self>) -> impl Future<Output = Vec<(i64, String)>> + Send + '_;
    }

    macro_rules! probe {
        ($db:ty, $literal_finish:expr, $select:literal) => {
            impl Probe for $db {
                const LITERAL_FINISH: bool = $literal_finish;

                async fn stored(pool: &Pool<Self>, digest: &[u8; 32]) -> Option<Stored> {
                    let row = sqlx::query($select)
                        .bind(digest.to_vec())
                        .fetch_optional(pool)
                        .await
                        .expect("read the record")?;
                    Some(Stored {
                        principal: row.try_get(0).expect("principal"),
                        method: row.try_get(1).expect("method"),
                        route: row.try_get(2).expect("route"),
                        state: row.try_get(3).expect("state"),
                        status: row.try_get(4).expect("status"),
                        headers: row.try_get(5).expect("headers"),
                        body: row.try_get(6).expect("body"),
                    })
                }

                async fn create_canary(pool: &Pool<Self>) {
                    sqlx::raw_sql(
                        "CREATE TABLE canary (id BIGINT PRIMARY KEY, note TEXT NOT NULL); \
                         INSERT INTO canary (id, note) VALUES (1, 'still here')",
                    )
                    .execute(pool)
                    .await
                    .expect("create the canary");
                }

                async fn canary(pool: &Pool<Self>) -> Vec<(i64, String)> {
                    sqlx::query("SELECT id, note FROM canary ORDER BY id")
                        .fetch_all(pool)
                        .await
                        .expect("the canary table is still there")
                        .iter()
                        .map(|row| (row.get(0), row.get(1)))
                        .collect()
                }
            }
        };
    }

    #[cfg(feature = "sqlite")]
    probe!(
        sqlx::Sqlite,
        false,
        "SELECT principal, method, route, state, status, headers, body \
         FROM idempotency_records WHERE key_digest = ?1"
    );
    #[cfg(feature = "postgres")]
    probe!(
        sqlx::Postgres,
        true,
        "SELECT principal, method, route, state, status, headers, body \
         FROM idempotency_records WHERE key_digest = $1"
    );
    // The record's `UPDATE` is a command of its own there, prepared and bound.
    #[cfg(feature = "mysql")]
    probe!(
        sqlx::MySql,
        false,
        "SELECT principal, method, route, state, status, headers, body \
         FROM idempotency_records WHERE key_digest = ?"
    );
}

/// The statements sqlx logs, kept so a test can tell a value written into SQL text from a
/// bound one.
mod statements {
    use std::fmt;
    use std::sync::{Mutex, OnceLock};

    use tracing::field::{Field, Visit};
    use tracing::{Event, Subscriber};
    use tracing_subscriber::Layer;
    use tracing_subscriber::filter::filter_fn;
    use tracing_subscriber::layer::{Context, SubscriberExt};

    // Lowercased, so a backend spelling hexadecimal in capitals is found as well.
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

    struct Capture;

    struct Text(String);

    impl Visit for Text {
        fn record_str(&mut self, _field: &Field, value: &str) {
            self.0.push_str(value);
            self.0.push('\n');
        }

        fn record_debug(&mut self, _field: &Field, value: &dyn fmt::Debug) {
            use std::fmt::Write;
            let _ = writeln!(self.0, "{value:?}");
        }
    }

    impl<S: Subscriber> Layer<S> for Capture {
        fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
            let mut text = Text(String::new());
            event.record(&mut text);
            // The records' table, or the schema's functions that write it.
            if text.0.contains("idempotency_records") || text.0.contains("axum_idempotency_") {
                SEEN.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(text.0.to_lowercase());
            }
        }
    }

    /// Installs the capture as this test binary's subscriber, once.
    pub(crate) fn capture() {
        static INSTALLED: OnceLock<()> = OnceLock::new();
        INSTALLED.get_or_init(|| {
            let layer = Capture.with_filter(filter_fn(|meta| meta.target() == "sqlx::query"));
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
                .expect("no other subscriber in this binary");
        });
    }

    /// Whether any statement logged so far holds `hex` in its text.
    pub(crate) fn any_holds(hex: &str) -> bool {
        SEEN.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .any(|sql| sql.contains(hex))
    }
}

/// A served app whose routes echo what they were sent, authenticated by a principal id that
/// may hold anything.
mod site {
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::extract::{Path, Request, State};
    use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
    use axum::middleware::{self, Next};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use axum::{Extension, Router};
    use axum_idempotency::{IdempotencyLayer, Tx};
    use bytes::Bytes;
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    use sqlx::Pool;

    use crate::common::{Backend, Db, Reply, User};

    /// Route templates that are themselves hostile: every byte a request line may carry
    /// unencoded, and so every byte a matched template (the record's `route`) can hold.
    pub(crate) const HOSTILE_ROUTES: &[&str] = &[
        "/r/');DROP/**/TABLE/**/canary;--/{name}",
        "/q/'';\\'\\\\/$$/$t$/*/*/%27%00/{name}",
        "/u/é/😀/\u{202E}/\"x\"/{name}",
    ];
    pub(crate) const PLAIN_ROUTE: &str = "/plain/{name}";

    /// A response header whose value holds quotes, a backslash, comment markers and bytes that
    /// are not UTF-8, stored in the record's `headers`.
    pub(crate) const ECHO: &[u8] = b"'\\\"; -- */ $$ \xff\xfe\x80";

    /// Larger than any body sent here, so what is refused is never a limit.
    const LIMIT: usize = 4 * 1024 * 1024;

    pub(crate) fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn unhex(text: &str) -> Option<Vec<u8>> {
        if !text.len().is_multiple_of(2) {
            return None;
        }
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
            .collect()
    }

    /// The business row a request writes: one per principal and key.
    pub(crate) fn label(principal: &str, key: &str) -> String {
        format!("{}|{key}", hex(principal.as_bytes()))
    }

    /// `Authorization: Bearer id:<hex of the principal id>`: the id an identity provider
    /// vouches for may hold anything, so the test spells it in a form a header can carry (and
    /// behind a prefix, as a header value loses its trailing spaces and the empty id would
    /// leave `Bearer ` with nothing after it).
    async fn authenticate(mut request: Request, next: Next) -> Response {
        let user = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer id:"))
            .and_then(unhex)
            .and_then(|id| String::from_utf8(id).ok())
            .map(User);
        if let Some(user) = user {
            request.extensions_mut().insert(user);
        }
        next.run(request).await
    }

    async fn echo<DB: Db>(
        State(executions): State<Arc<AtomicUsize>>,
        Extension(user): Extension<User>,
        Path(name): Path<String>,
        headers: HeaderMap,
        mut tx: Tx<DB>,
        body: Bytes,
    ) -> Response {
        executions.fetch_add(1, Ordering::SeqCst);
        let key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let id = DB::insert_effect(&mut tx, &label(&user.0, key))
            .await
            .expect("insert effect");
        let value = |text: String| HeaderValue::from_str(&text).expect("hex is a header value");
        let mut answer = HeaderMap::new();
        answer.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        // Fixed width, so a response's stored headers weigh the same whatever its id.
        answer.insert("x-effect", value(format!("{id:012}")));
        answer.insert("x-principal", value(hex(user.0.as_bytes())));
        answer.insert("x-name", value(hex(name.as_bytes())));
        answer.insert(
            "x-echo",
            HeaderValue::from_bytes(ECHO).expect("visible bytes"),
        );
        (StatusCode::CREATED, answer, body).into_response()
    }

    pub(crate) struct Site<DB: Db> {
        pub(crate) pool: Pool<DB>,
        pub(crate) layer: IdempotencyLayer<DB>,
        executions: Arc<AtomicUsize>,
        addr: SocketAddr,
        client: Client<HttpConnector, Full<Bytes>>,
        server: tokio::task::JoinHandle<()>,
    }

    impl<DB: Db> Drop for Site<DB> {
        fn drop(&mut self) {
            self.server.abort();
        }
    }

    impl<DB: Db> Site<DB> {
        pub(crate) async fn serve(pool: Pool<DB>) -> Self {
            let store = DB::store(pool.clone());
            store.migrate().await.expect("migrate");
            DB::create_effects_table(&pool).await;
            let layer = IdempotencyLayer::new(store)
                .principal_extension::<User>()
                .max_request_body(LIMIT)
                .max_response_body(LIMIT);
            let executions = Arc::new(AtomicUsize::new(0));
            // Segments starting with `*` are literal, as `/**/` in a template must be.
            let mut router = Router::new()
                .without_v07_checks()
                .route(PLAIN_ROUTE, post(echo::<DB>));
            for route in HOSTILE_ROUTES {
                router = router.route(route, post(echo::<DB>));
            }
            let router = router
                .route_layer(layer.clone())
                .layer(middleware::from_fn(authenticate))
                .with_state(executions.clone());
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("addr");
            let server = tokio::spawn(async move {
                axum::serve(listener, router).await.expect("serve");
            });
            Self {
                pool,
                layer,
                executions,
                addr,
                client: Client::builder(TokioExecutor::new()).build_http(),
                server,
            }
        }

        pub(crate) fn executions(&self) -> usize {
            self.executions.load(Ordering::SeqCst)
        }

        /// `POST path` as `principal` with `key` and a raw body.
        pub(crate) async fn post(
            &self,
            path: &str,
            principal: &str,
            key: &str,
            body: &[u8],
        ) -> Reply {
            let request = hyper::Request::post(format!("http://{}{path}", self.addr))
                .header(header::CONTENT_TYPE, "application/octet-stream")
                .header(
                    header::AUTHORIZATION,
                    format!("Bearer id:{}", hex(principal.as_bytes())),
                )
                .header("idempotency-key", key)
                .body(Full::new(Bytes::copy_from_slice(body)))
                .expect("request");
            Reply::receive(&self.client, request).await
        }
    }

    /// A fresh database with a canary table, and the app on it.
    pub(crate) async fn isolated<DB: crate::probe::Probe>()
    -> (crate::common::Isolated<DB>, Site<DB>) {
        crate::statements::capture();
        let isolated = <DB as Backend>::fresh(8).await;
        DB::create_canary(&isolated.pool).await;
        let site = Site::serve(isolated.pool.clone()).await;
        (isolated, site)
    }
}

mod suite {
    use std::future::Future;
    use std::pin::Pin;

    use axum::http::{Request, StatusCode};
    use axum_idempotency::{Fingerprint, Fingerprinter, IdempotencyKey, Outcome, Scope, Tx};
    use bytes::Bytes;

    use crate::common::{Backend, Db, Reply, unique};
    use crate::probe::{CANARY_NOTE, Probe, Stored};
    use crate::site::{ECHO, HOSTILE_ROUTES, PLAIN_ROUTE, Site, hex, isolated, label};
    use crate::statements;

    /// Principal ids an identity provider could vouch for, each hostile to some SQL dialect.
    /// Several differ from another only in the hostile part (`alice` and `alice'`,
    /// `alice'` and `alice''` and `alice\'`), so a quote lost or doubled on the way would make
    /// two callers share a key.
    const HOSTILE_PRINCIPALS: &[&str] = &[
        "alice",
        "alice'",
        "alice''",
        "alice\\'",
        "alice\\",
        "alice'); DROP TABLE canary; --",
        "'; DELETE FROM idempotency_records; --",
        "' OR '1'='1",
        "\\",
        "\\\\'\\",
        "*/ SELECT 1; /*",
        "-- ",
        "#",
        "$$; DROP TABLE canary; $$",
        "$tag$ $$ $tag$",
        "E'\\x27'",
        "X'27'",
        "0x27",
        "decode('27', 'hex')",
        "\"double\" `back` [square]",
        "%_",
        "line\nbreak\r\ttab\u{1a}\u{8}",
        "Zoë 😀 𝔘 \u{202E}gnp.exe \u{feff}",
        "",
        " ",
    ];

    /// The record's digest as the layer computes it for `POST route` with `key`.
    fn digest(principal: &str, route: &str, key: &str) -> [u8; 32] {
        let key = key.parse::<IdempotencyKey>().expect("key");
        *Scope::new(principal, "POST", route, key)
            .scoped_key()
            .digest()
    }

    /// The headers the echo route answers with that a replay must reproduce.
    fn echoed(reply: &Reply) -> Vec<(String, Vec<u8>)> {
        [
            "content-type",
            "x-effect",
            "x-principal",
            "x-name",
            "x-echo",
        ]
        .into_iter()
        .map(|name| {
            let value = reply.headers.get(name).map(|v| v.as_bytes().to_vec());
            (name.to_owned(), value.unwrap_or_default())
        })
        .collect()
    }

    fn holds(haystack: &[u8], needle: &[u8]) -> bool {
        needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
    }

    /// Sends one keyed POST and its retry, and checks everything a hostile value could break:
    /// the answer, the replay, the business run once, the record as stored, the canary.
    async fn round_trip<DB: Probe>(
        site: &Site<DB>,
        route: &str,
        path: &str,
        principal: &str,
        key: &str,
        body: &[u8],
    ) -> Reply {
        let what = format!("{principal:?} {path:?} ({} body bytes)", body.len());
        let first = site.post(path, principal, key, body).await;
        assert_eq!(first.status, StatusCode::CREATED, "{what}: {first:?}");
        assert!(!first.replayed(), "{what}: a new key executes");
        assert_eq!(first.body, body, "{what}: the echo");
        assert_eq!(
            first.headers["x-principal"].as_bytes(),
            hex(principal.as_bytes()).as_bytes(),
            "{what}: the handler saw the principal as sent"
        );

        let again = site.post(path, principal, key, body).await;
        assert_eq!(again.status, first.status, "{what}: {again:?}");
        assert!(again.replayed(), "{what}: the retry replays");
        assert_eq!(again.body, first.body, "{what}: replayed body");
        assert_eq!(echoed(&again), echoed(&first), "{what}: replayed headers");

        assert_eq!(
            DB::count_effects(&site.pool, &label(principal, key)).await,
            1,
            "{what}: the business ran once"
        );
        let stored = DB::stored(&site.pool, &digest(principal, route, key))
            .await
            .unwrap_or_else(|| panic!("{what}: no record under the layer's digest"));
        let Stored {
            principal: stored_principal,
            method,
            route: stored_route,
            state,
            status,
            headers,
            body: stored_body,
        } = stored;
        assert_eq!(
            stored_principal,
            Some(shown(principal)),
            "{what}: principal read back"
        );
        assert_eq!(stored_route, shown(route), "{what}: route read back");
        assert_eq!(method, "POST", "{what}");
        assert_eq!(state, "completed", "{what}");
        assert_eq!(status, Some(201), "{what}");
        assert_eq!(
            stored_body.as_deref(),
            Some(body),
            "{what}: body read back byte for byte"
        );
        let headers = headers.unwrap_or_default();
        assert!(holds(&headers, ECHO), "{what}: stored header bytes");
        assert!(
            holds(&headers, hex(principal.as_bytes()).as_bytes()),
            "{what}: stored principal header"
        );
        assert_canary::<DB>(site).await;
        first
    }

    async fn assert_canary<DB: Probe>(site: &Site<DB>) {
        assert_eq!(
            DB::canary(&site.pool).await,
            [(1, CANARY_NOTE.to_owned())],
            "the canary table and its row are untouched"
        );
    }

    async fn dispose<DB: Probe>(isolated: crate::common::Isolated<DB>, site: Site<DB>) {
        drop(site);
        <DB as Backend>::dispose(isolated).await;
    }

    pub(crate) async fn hostile_principals_round_trip_and_never_share_a_key<DB: Probe>() {
        let (isolated, site) = isolated::<DB>().await;
        // One key for every principal: only the principal tells their scopes apart.
        let key = unique("principal");
        let body = b"same body for everyone";
        let path = PLAIN_ROUTE.replace("{name}", "p");
        let mut firsts = Vec::new();
        for principal in HOSTILE_PRINCIPALS {
            let first = round_trip(&site, PLAIN_ROUTE, &path, principal, &key, body).await;
            firsts.push(first);
        }
        // The first requests ran back to back; a retry of each, after all of them, still gets
        // its own principal's answer, never a neighbour's.
        for (principal, first) in HOSTILE_PRINCIPALS.iter().zip(&firsts) {
            let again = site.post(&path, principal, &key, body).await;
            assert!(again.replayed(), "{principal:?}");
            assert_eq!(echoed(&again), echoed(first), "{principal:?}");
        }
        let effects: std::collections::HashSet<_> = firsts
            .iter()
            .map(|r| r.headers["x-effect"].clone())
            .collect();
        assert_eq!(effects.len(), HOSTILE_PRINCIPALS.len(), "one effect each");
        assert_eq!(site.executions(), HOSTILE_PRINCIPALS.len());
        assert_eq!(
            DB::count_records(&site.pool).await,
            i64::try_from(HOSTILE_PRINCIPALS.len()).expect("count"),
            "one record per principal"
        );
        dispose(isolated, site).await;
    }

    pub(crate) async fn hostile_route_templates_and_path_segments_round_trip<DB: Probe>() {
        let (isolated, site) = isolated::<DB>().await;
        // Segments as a client percent-encodes them; the layer keeps the template, and the
        // concrete path only reaches the fingerprint and the handler.
        let names = [
            ("%27", "'"),
            (
                "%27%29%3B%20DROP%20TABLE%20canary%3B%20--",
                "'); DROP TABLE canary; --",
            ),
            ("%5C%27%5C", "\\'\\"),
            ("%00%27%00", "\0'\0"),
            ("%2A%2F%20%2F%2A", "*/ /*"),
            ("%24%24%3B%24t%24", "$$;$t$"),
            ("%F0%9F%98%80%E2%80%AE", "😀\u{202E}"),
            ("%2527", "%27"),
            ("%2F..%2F", "/../"),
            ("'", "'"),
            ("é", "é"),
        ];
        let mut sent = 0;
        for route in HOSTILE_ROUTES {
            for (encoded, decoded) in names {
                let path = route.replace("{name}", encoded);
                let key = unique("route");
                let first = round_trip(&site, route, &path, "alice", &key, b"route").await;
                assert_eq!(
                    first.headers["x-name"].as_bytes(),
                    hex(decoded.as_bytes()).as_bytes(),
                    "{path:?}: the handler saw the segment decoded"
                );
                sent += 1;
            }
        }
        assert_eq!(site.executions(), sent);
        dispose(isolated, site).await;
    }

    /// Bytes from a fixed seed with every troublesome byte mixed in, led by a unique marker so
    /// the statements that carry this body in their text can be found.
    fn body_of(len: usize, seed: u64) -> Vec<u8> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let hostile = b"'\\\0\"`;-*/$";
        let mut body: Vec<u8> = (0..len)
            .map(|i| {
                if i % 7 == 0 {
                    hostile[rng.usize(..hostile.len())]
                } else {
                    rng.u8(..)
                }
            })
            .collect();
        let marker = unique("marker");
        let n = marker.len().min(len);
        body[..n].copy_from_slice(&marker.as_bytes()[..n]);
        body
    }

    /// Whether a statement sqlx logged carried `body` in its text.
    fn written_into_sql(body: &[u8]) -> bool {
        statements::any_holds(&hex(&body[..body.len().min(48)]))
    }

    pub(crate) async fn hostile_bodies_round_trip_byte_for_byte<DB: Probe>() {
        let (isolated, site) = isolated::<DB>().await;
        let route = HOSTILE_ROUTES[0];
        let path = route.replace("{name}", "body");
        let all_bytes: Vec<u8> = (0..=255).collect();
        let bodies: Vec<Vec<u8>> = vec![
            b"'); DROP TABLE canary; --".to_vec(),
            b"'; DELETE FROM idempotency_records WHERE '1'='1".to_vec(),
            b"\\'); DROP TABLE canary; -- \\".to_vec(),
            b"$$); DROP TABLE canary; $$".to_vec(),
            b"*/; DROP TABLE canary; /*".to_vec(),
            b"\0".to_vec(),
            b"\0\0'\0\\\0".to_vec(),
            vec![
                0xff, 0xfe, b'\'', 0xc3, 0x28, 0x00, b'\\', 0xa0, 0xa1, 0xed, 0xa0, 0x80,
            ],
            "Zoë 😀 \u{202E} 𝔘".as_bytes().to_vec(),
            all_bytes.iter().rev().copied().collect(),
            all_bytes,
            Vec::new(),
        ];
        for body in &bodies {
            round_trip(&site, route, &path, "alice", &unique("body"), body).await;
        }
        // Past the 64 KiB a store writes into a statement: bound, whatever the backend.
        let mebibyte = body_of(1024 * 1024, 1);
        round_trip(&site, route, &path, "alice", &unique("mib"), &mebibyte).await;
        assert!(
            !written_into_sql(&mebibyte),
            "a 1 MiB response never travels in the statement text"
        );
        assert_eq!(site.executions(), bodies.len() + 1);
        dispose(isolated, site).await;
    }

    pub(crate) async fn responses_either_side_of_the_literal_limit_round_trip<DB: Probe>() {
        const FUSED_LIMIT: usize = 64 * 1024;
        let (isolated, site) = isolated::<DB>().await;
        let route = HOSTILE_ROUTES[1];
        let path = route.replace("{name}", "limit");
        let principal = "alice'); DROP TABLE canary; --";
        // The limit counts the stored headers with the body; the echo's headers weigh the same
        // for every body of five-digit length, so one probe tells their weight.
        let probe_key = unique("probe");
        round_trip(
            &site,
            route,
            &path,
            principal,
            &probe_key,
            &body_of(60_000, 2),
        )
        .await;
        let headers = DB::stored(&site.pool, &digest(principal, route, &probe_key))
            .await
            .and_then(|stored| stored.headers)
            .expect("stored headers")
            .len();

        let under = body_of(FUSED_LIMIT - headers, 3);
        let over = body_of(FUSED_LIMIT - headers + 1, 4);
        round_trip(&site, route, &path, principal, &unique("under"), &under).await;
        round_trip(&site, route, &path, principal, &unique("over"), &over).await;
        if DB::LITERAL_FINISH {
            assert!(
                written_into_sql(&under),
                "a response of exactly the limit is written into the statement"
            );
        }
        assert!(
            !written_into_sql(&over),
            "a response one byte over the limit is bound"
        );
        dispose(isolated, site).await;
    }

    pub(crate) async fn hostile_job_scopes_round_trip<DB: Probe>() {
        let (isolated, site) = isolated::<DB>().await;
        // A job names its own method and route, so they may hold what no request line can:
        // spaces, control characters, any unicode.
        let scopes = [
            ("REFUND'; --", "/jobs/'); DROP TABLE canary; --"),
            ("RE\\FUND", "/jobs/\\'/$$/*/ \t\r\n"),
            ("R\u{e9}fund 😀", "nightly reconciliation \u{202E}"),
        ];
        for (i, (method, route)) in scopes.into_iter().enumerate() {
            let principal = HOSTILE_PRINCIPALS[5];
            job_round_trip(&site, principal, method, route, 10 + i as u64).await;
        }
        dispose(isolated, site).await;
    }

    type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

    /// A job's work: one business row, and the body as its answer.
    fn job_work<DB: Db>(
        effect: String,
        body: Vec<u8>,
    ) -> impl FnMut(Tx<DB>) -> BoxFuture<'static, (StatusCode, Bytes)> + Send + 'static {
        move |mut tx: Tx<DB>| {
            let (effect, body) = (effect.clone(), body.clone());
            Box::pin(async move {
                DB::insert_effect(&mut tx, &effect).await.expect("insert");
                (StatusCode::ACCEPTED, Bytes::from(body))
            })
        }
    }

    /// A job's scope, under a key of its own.
    fn job_scope(principal: &str, method: &str, route: &str) -> (String, Scope) {
        let key = unique("job");
        let scope = Scope::new(
            principal,
            method,
            route,
            key.parse::<IdempotencyKey>().expect("key"),
        );
        (key, scope)
    }

    fn job_fingerprint(body: &[u8]) -> Fingerprint {
        let (parts, _) = Request::post("/jobs")
            .body(())
            .expect("request")
            .into_parts();
        Fingerprinter::new().fingerprint(&parts, body)
    }

    /// Runs a job twice through the engine's public claim, as background work does, and checks
    /// its replay and its record.
    async fn job_round_trip<DB: Probe>(
        site: &Site<DB>,
        principal: &str,
        method: &str,
        route: &str,
        seed: u64,
    ) {
        let what = format!("{principal:?} {method:?} {route:?}");
        let engine = site.layer.engine();
        let (key, scope) = job_scope(principal, method, route);
        let body = body_of(100, seed);
        let fingerprint = job_fingerprint(&body);
        let effect = label(principal, &key);
        let first = engine
            .run(
                &scope,
                fingerprint,
                job_work::<DB>(effect.clone(), body.clone()),
            )
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert_eq!(first.outcome, Outcome::Executed, "{what}");
        let again = engine
            .run(
                &scope,
                fingerprint,
                job_work::<DB>(effect.clone(), body.clone()),
            )
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert_eq!(again.outcome, Outcome::Replayed, "{what}");
        assert_eq!(again.response.status(), StatusCode::ACCEPTED, "{what}");
        assert_eq!(again.response.body(), first.response.body(), "{what}");
        assert_eq!(DB::count_effects(&site.pool, &effect).await, 1, "{what}");
        let stored = DB::stored(&site.pool, scope.scoped_key().digest())
            .await
            .unwrap_or_else(|| panic!("{what}: no record"));
        assert_eq!(stored.principal, Some(shown(principal)), "{what}");
        assert_eq!(stored.method, shown(method), "{what}");
        assert_eq!(stored.route, shown(route), "{what}");
        assert_eq!(stored.body.as_deref(), Some(&body[..]), "{what}");
        assert_canary::<DB>(site).await;
    }

    /// A scope's text as the records table shows it: NUL, which PostgreSQL's `text` cannot
    /// hold, as U+FFFD on every backend.
    fn shown(text: &str) -> String {
        text.replace('\0', "\u{fffd}")
    }

    /// Principals holding NUL, each next to its neighbour without it.
    const NUL_PRINCIPALS: &[&str] = &["alice\0", "\0alice", "ali\0ce'); DROP TABLE canary; --"];

    pub(crate) async fn nul_in_principal_method_and_route_round_trips<DB: Probe>() {
        let (isolated, site) = isolated::<DB>().await;
        let key = unique("nul");
        let path = PLAIN_ROUTE.replace("{name}", "p");
        for principal in NUL_PRINCIPALS.iter().chain(&["alice"]) {
            round_trip(&site, PLAIN_ROUTE, &path, principal, &key, b"nul").await;
        }
        assert_eq!(
            site.executions(),
            NUL_PRINCIPALS.len() + 1,
            "no two share a scope"
        );
        job_round_trip(&site, "alice\0", "RE\0FUND", "/jobs/\0/'\0--", 20).await;
        dispose(isolated, site).await;
    }
}
