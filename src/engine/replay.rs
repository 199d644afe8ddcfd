//! Answering from a record: the replay, the refusal of another intent, and which of a
//! response's headers are kept to be replayed at all.

use http::{HeaderMap, HeaderName, HeaderValue, header};

use super::decide::{self, Existing};
use super::outcome::{Answer, Logged, Outcome};
use super::{Engine, IDEMPOTENT_REPLAYED};
use crate::Backend;
use crate::error::Rejection;
use crate::fingerprint::{Fingerprint, Verbatim};
use crate::record::NewRecord;
use crate::record::{Record, RecordState, StoredResponse};
use crate::scope::ScopedKey;

/// Headers never stored for replay unless asked for by [`Engine::replay_header`]: they belong
/// to the first exchange (cookies, dates) or to the connection, not to the resource.
const UNREPLAYED: [HeaderName; 11] = [
    header::SET_COOKIE,
    header::DATE,
    header::CONTENT_LENGTH,
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// Replays a final record for the same intent; refuses another intent; reports work still
/// in flight.
pub(crate) fn answer_existing<E>(record: &Record, same_intent: bool) -> Answer<E> {
    let stored = record.response.as_ref();
    match (
        decide::existing(record.state, stored.is_some(), same_intent),
        stored,
    ) {
        (Existing::KeyReused, _) => Answer::reject(Rejection::KeyReused, Logged::Mismatch),
        (Existing::Replay, Some(stored)) => {
            let mut response = stored.to_response();
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            Answer::respond(response, Outcome::Replayed, Logged::Replayed)
        }
        _ => Answer::in_flight(),
    }
}

impl<DB: Backend> Engine<DB> {
    /// Answers from a record read from the store, and keeps it for the next replay when the
    /// replay cache is on, with `request` when that is the same intent.
    pub(super) fn answer_stored<E>(
        &self,
        key: ScopedKey,
        record: Record,
        fingerprint: Fingerprint,
        request: Option<Verbatim>,
    ) -> Answer<E> {
        let same_intent = record.fingerprint == fingerprint;
        let answer = answer_existing(&record, same_intent);
        if let Some(cache) = &self.settings.cache {
            cache.insert(
                key,
                record,
                request.filter(|_| same_intent),
                self.store.clock().now(),
            );
        }
        answer
    }

    /// Keeps the outcome this engine has just committed for `record` and the `request` it
    /// answers, when the replay cache is on.
    pub(super) fn remember(
        &self,
        record: &NewRecord<'_>,
        state: RecordState,
        response: &StoredResponse,
        request: Option<Verbatim>,
    ) {
        if let Some(cache) = &self.settings.cache {
            let kept = Record {
                state,
                fingerprint: record.fingerprint,
                response: Some(response.clone()),
                expires_at: record.expires_at,
                lease_expires_at: None,
            };
            cache.insert(record.key, kept, request, self.store.clock().now());
        }
    }

    /// What of `response` is kept to be replayed: status, body, and the headers that describe
    /// the resource rather than the exchange or the connection.
    pub(super) fn storable(&self, response: &http::Response<bytes::Bytes>) -> StoredResponse {
        let mut headers = HeaderMap::new();
        // Headers the response itself names in `Connection` are hop-by-hop too.
        let named_by_connection: Vec<String> = response
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|v| v.trim().to_ascii_lowercase())
            .collect();
        for (name, value) in response.headers() {
            let opted_in = self.settings.replayed_headers.contains(name)
                && !matches!(
                    *name,
                    header::CONTENT_LENGTH | header::CONNECTION | header::TRANSFER_ENCODING
                );
            let excluded =
                UNREPLAYED.contains(name) || named_by_connection.iter().any(|n| n == name.as_str());
            if opted_in || !excluded {
                headers.append(name.clone(), value.clone());
            }
        }
        StoredResponse {
            status: response.status(),
            headers,
            body: response.body().clone(),
        }
    }
}
