//! A strict single-pass JSON canonicaliser.
//!
//! It writes the canonical text while it parses: no value tree is built. An object's members are
//! written in input order, and only when they turn out not to be sorted are their byte ranges
//! sorted and copied once into place. Numbers never pass through `f64`: their digits are
//! normalised as text, so two spellings are equal exactly when their decimal values are.

use std::cell::RefCell;

/// Deeper nesting is refused, so hostile input cannot exhaust the stack.
pub(crate) const MAX_DEPTH: usize = 128;

/// Buffers larger than this are released after use rather than kept for the next request.
const RETAINED_CAPACITY: usize = 2 * 1024 * 1024;

/// The input is not JSON this canonicaliser accepts.
#[derive(Debug)]
pub(crate) struct Invalid;

/// A parsed RFC 6901 JSON Pointer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Pointer {
    tokens: Vec<Token>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Token {
    name: Box<[u8]>,
    /// The array index this token names, when it is one in RFC 6901's spelling.
    index: Option<usize>,
}

impl Pointer {
    /// Parses a pointer; one not starting with `/` is read as if it did.
    pub(crate) fn parse(pointer: &str) -> Self {
        let pointer = pointer.strip_prefix('/').unwrap_or(pointer);
        let tokens = pointer
            .split('/')
            .map(|raw| {
                // RFC 6901 §4: `~1` first, then `~0`, so `~01` stays `~1`.
                let name = raw.replace("~1", "/").replace("~0", "~");
                let index = array_index(&name);
                Token {
                    name: name.into_bytes().into_boxed_slice(),
                    index,
                }
            })
            .collect();
        Self { tokens }
    }
}

fn array_index(token: &str) -> Option<usize> {
    let canonical = token == "0" || (!token.starts_with('0') && !token.is_empty());
    if canonical && token.bytes().all(|b| b.is_ascii_digit()) {
        token.parse().ok()
    } else {
        None
    }
}

/// One member of an object being written.
struct Member {
    key: Key,
    /// The key's first 8 bytes, big-endian and zero-padded: most comparisons end here, without
    /// a call to `memcmp`.
    prefix: u64,
    text: (usize, usize),
    removed: bool,
}

/// Where a member's unescaped key lies: in the input when it had no escapes, else in
/// `Scratch::keys`.
#[derive(Clone, Copy)]
enum Key {
    Input(usize, usize),
    Unescaped(usize, usize),
}

#[inline]
fn key_bytes<'k>(input: &'k [u8], unescaped: &'k [u8], key: Key) -> &'k [u8] {
    match key {
        Key::Input(start, end) => &input[start..end],
        Key::Unescaped(start, end) => &unescaped[start..end],
    }
}

#[inline]
fn key_prefix(key: &[u8]) -> u64 {
    if let Some(Ok(bytes)) = key.get(..8).map(<[u8; 8]>::try_from) {
        return u64::from_be_bytes(bytes);
    }
    // A byte loop: for keys this short a `memcpy` call costs more than the copy.
    let mut prefix = 0u64;
    for (i, &b) in key.iter().enumerate() {
        prefix |= u64::from(b) << (56 - 8 * i);
    }
    prefix
}

/// Byte order of the two members' keys.
#[inline]
fn key_order(input: &[u8], unescaped: &[u8], a: &Member, b: &Member) -> std::cmp::Ordering {
    // Zero padding keeps the order: a key that ends inside the prefix is a prefix of the other
    // one there, or both are equal so far and the full comparison decides.
    a.prefix
        .cmp(&b.prefix)
        .then_with(|| key_bytes(input, unescaped, a.key).cmp(key_bytes(input, unescaped, b.key)))
}

/// Buffers reused across calls on one thread, so a request allocates nothing in steady state.
#[derive(Default)]
pub(crate) struct Scratch {
    /// The canonical text.
    pub(crate) out: Vec<u8>,
    /// Unescaped keys, for those members of the open objects whose keys had escapes.
    keys: Vec<u8>,
    members: Vec<Member>,
    /// Indexes of the pointers that still match the current path, stacked by depth.
    active: Vec<usize>,
    sorted: Vec<u8>,
    /// The members of the object being sorted, as (key prefix, index): sorting these small
    /// pairs moves far less than sorting the members themselves.
    order: Vec<(u64, usize)>,
}

impl Scratch {
    fn release_if_large(&mut self) {
        fn trim<T>(v: &mut Vec<T>) {
            if v.capacity() * size_of::<T>() > RETAINED_CAPACITY {
                *v = Vec::new();
            }
        }
        trim(&mut self.out);
        trim(&mut self.keys);
        trim(&mut self.members);
        trim(&mut self.sorted);
        trim(&mut self.order);
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` on the canonical form of `input`, or on `None` when it is not valid JSON.
pub(crate) fn with_canonical<R>(
    input: &[u8],
    pointers: &[Pointer],
    f: impl FnOnce(Option<&mut Vec<u8>>) -> R,
) -> R {
    SCRATCH.with(|cell| {
        // A nested call from inside `f` finds the cell borrowed; it gets fresh buffers instead.
        let mut fallback;
        let mut borrowed = cell.try_borrow_mut();
        let scratch: &mut Scratch = match borrowed.as_deref_mut() {
            Ok(s) => s,
            Err(_) => {
                fallback = Scratch::default();
                &mut fallback
            }
        };
        let result = match canonicalise(input, pointers, scratch) {
            Ok(()) => f(Some(&mut scratch.out)),
            Err(Invalid) => f(None),
        };
        scratch.release_if_large();
        result
    })
}

/// Writes the canonical form of `input` into `scratch.out`.
pub(crate) fn canonicalise(
    input: &[u8],
    pointers: &[Pointer],
    scratch: &mut Scratch,
) -> Result<(), Invalid> {
    // JSON text is UTF-8 (RFC 8259 §8.1); checking it once lets the string scanner copy
    // non-ASCII bytes without decoding them.
    std::str::from_utf8(input).map_err(|_| Invalid)?;
    scratch.out.clear();
    scratch.out.reserve(input.len());
    scratch.keys.clear();
    scratch.members.clear();
    scratch.active.clear();
    scratch.active.extend(0..pointers.len());
    let mut parser = Parser {
        input,
        pos: 0,
        pointers,
        s: scratch,
    };
    parser.skip_whitespace();
    parser.value(0, 0..pointers.len())?;
    parser.skip_whitespace();
    if parser.pos == input.len() {
        Ok(())
    } else {
        Err(Invalid)
    }
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    pointers: &'a [Pointer],
    s: &'a mut Scratch,
}

/// Bytes that end the fast copy loop inside a string: the quote, the backslash and controls.
static STRING_SPECIAL: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = true;
        b += 1;
    }
    table[b'"' as usize] = true;
    table[b'\\' as usize] = true;
    table
};

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.pos += 1;
        }
    }

    fn expect(&mut self, byte: u8) -> Result<(), Invalid> {
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(Invalid)
        }
    }

    /// `depth` is the length of the path to this value; `active` the range of `s.active` holding
    /// the pointers that match that path so far.
    // Inlined into the containers' loops, which stay out of line: a scalar then costs no call,
    // and only nesting pays for the containers' large stack frames.
    #[inline]
    fn value(&mut self, depth: usize, active: std::ops::Range<usize>) -> Result<(), Invalid> {
        match self.peek().ok_or(Invalid)? {
            b'{' => self.object(depth, active),
            b'[' => self.array(depth, active),
            b'"' => {
                let start = self.pos;
                let plain_end = scan_plain(self.input, start + 1);
                if self.input.get(plain_end) == Some(&b'"') {
                    // No escapes: the string as sent is canonical.
                    self.pos = plain_end + 1;
                    self.s.out.extend_from_slice(&self.input[start..self.pos]);
                    return Ok(());
                }
                // The plain run already scanned is copied as is, not scanned again.
                self.pos = plain_end;
                self.s.out.extend_from_slice(&self.input[start..plain_end]);
                string(self.input, &mut self.pos, &mut self.s.out, true)?;
                self.s.out.push(b'"');
                Ok(())
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => Err(Invalid),
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<(), Invalid> {
        if self.input[self.pos..].starts_with(word) {
            self.pos += word.len();
            self.s.out.extend_from_slice(word);
            Ok(())
        } else {
            Err(Invalid)
        }
    }

    #[inline(never)]
    fn object(&mut self, depth: usize, active: std::ops::Range<usize>) -> Result<(), Invalid> {
        if depth >= MAX_DEPTH {
            return Err(Invalid);
        }
        self.pos += 1;
        self.s.out.push(b'{');
        let content_start = self.s.out.len();
        let members_base = self.s.members.len();
        let keys_base = self.s.keys.len();
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            self.s.out.push(b'}');
            return Ok(());
        }
        let mut in_order = true;
        let mut written_any = false;
        loop {
            self.skip_whitespace();
            self.expect(b'"')?;
            let key = self.key()?;
            let name = key_bytes(self.input, &self.s.keys, key);
            let prefix = key_prefix(name);
            self.skip_whitespace();
            self.expect(b':')?;
            self.skip_whitespace();

            let (removed, child_active) = if active.is_empty() {
                let top = self.s.active.len();
                (false, top..top)
            } else {
                let name = key_bytes(self.input, &self.s.keys, key);
                descend(&mut self.s.active, self.pointers, depth, &active, |t| {
                    *t.name == *name
                })
            };

            let before_comma = self.s.out.len();
            if written_any {
                self.s.out.push(b',');
            }
            let text_start = self.s.out.len();
            match key {
                // Without escapes the key as sent, quotes included, is already canonical.
                Key::Input(start, end) => {
                    self.s.out.extend_from_slice(&self.input[start - 1..=end])
                }
                Key::Unescaped(start, end) => {
                    self.s.out.push(b'"');
                    encode_string(&self.s.keys[start..end], &mut self.s.out);
                    self.s.out.push(b'"');
                }
            }
            self.s.out.push(b':');
            self.value(depth + 1, child_active.clone())?;
            self.s.active.truncate(child_active.start);
            if removed {
                // Parsed to the end so the whole text is still validated, then dropped.
                self.s.out.truncate(before_comma);
            } else {
                written_any = true;
            }
            let member = Member {
                key,
                prefix,
                text: (text_start, self.s.out.len()),
                removed,
            };
            if let Some(previous) = self.s.members[members_base..].last() {
                in_order &= key_order(self.input, &self.s.keys, previous, &member).is_lt();
            }
            self.s.members.push(member);

            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(Invalid),
            }
        }
        if !in_order {
            self.sort_members(members_base, content_start)?;
        }
        self.s.members.truncate(members_base);
        self.s.keys.truncate(keys_base);
        self.s.out.push(b'}');
        Ok(())
    }

    /// Reads a member name from just after its opening quote through its closing quote.
    fn key(&mut self) -> Result<Key, Invalid> {
        let start = self.pos;
        let plain_end = scan_plain(self.input, start);
        if self.input.get(plain_end) == Some(&b'"') {
            self.pos = plain_end + 1;
            return Ok(Key::Input(start, plain_end));
        }
        let unescaped_start = self.s.keys.len();
        self.s.keys.extend_from_slice(&self.input[start..plain_end]);
        self.pos = plain_end;
        string(self.input, &mut self.pos, &mut self.s.keys, false)?;
        Ok(Key::Unescaped(unescaped_start, self.s.keys.len()))
    }

    /// Rewrites the members written since `content_start` in key order.
    fn sort_members(&mut self, members_base: usize, content_start: usize) -> Result<(), Invalid> {
        let input = self.input;
        let Scratch {
            out,
            keys,
            members,
            sorted,
            order,
            ..
        } = &mut *self.s;
        let members = &members[members_base..];
        order.clear();
        order.extend(members.iter().map(|m| m.prefix).zip(0..));
        let by_key = |a: &(u64, usize), b: &(u64, usize)| {
            a.0.cmp(&b.0).then_with(|| {
                key_bytes(input, keys, members[a.1].key).cmp(key_bytes(
                    input,
                    keys,
                    members[b.1].key,
                ))
            })
        };
        order.sort_unstable_by(by_key);
        // A duplicate key has no single meaning (parsers keep the first, the last, or both), so
        // two requests that differ only in which duplicate wins must not look alike: refuse it.
        if order.windows(2).any(|w| by_key(&w[0], &w[1]).is_eq()) {
            return Err(Invalid);
        }
        sorted.clear();
        // When less text precedes the object than it holds (always so for the outermost one),
        // copying that text too and swapping the buffers saves copying the members back.
        let swap = content_start <= out.len() - content_start;
        if swap {
            sorted.extend_from_slice(&out[..content_start]);
        }
        let mut first = true;
        for member in order
            .iter()
            .map(|&(_, i)| &members[i])
            .filter(|m| !m.removed)
        {
            if !first {
                sorted.push(b',');
            }
            first = false;
            sorted.extend_from_slice(&out[member.text.0..member.text.1]);
        }
        if swap {
            std::mem::swap(out, sorted);
        } else {
            out.truncate(content_start);
            out.extend_from_slice(sorted);
        }
        Ok(())
    }

    #[inline(never)]
    fn array(&mut self, depth: usize, active: std::ops::Range<usize>) -> Result<(), Invalid> {
        if depth >= MAX_DEPTH {
            return Err(Invalid);
        }
        self.pos += 1;
        self.s.out.push(b'[');
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.s.out.push(b']');
            return Ok(());
        }
        let mut written_any = false;
        let mut index = 0usize;
        loop {
            self.skip_whitespace();
            let (removed, child_active) = if active.is_empty() {
                let top = self.s.active.len();
                (false, top..top)
            } else {
                descend(&mut self.s.active, self.pointers, depth, &active, |t| {
                    t.index == Some(index)
                })
            };
            let before_comma = self.s.out.len();
            if written_any {
                self.s.out.push(b',');
            }
            self.value(depth + 1, child_active.clone())?;
            self.s.active.truncate(child_active.start);
            if removed {
                self.s.out.truncate(before_comma);
            } else {
                written_any = true;
            }
            index += 1;
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(Invalid),
            }
        }
        self.s.out.push(b']');
        Ok(())
    }

    /// Writes the number as `[-]D[eE]`: `D` its significant digits without leading or trailing
    /// zeros, `E` the exponent of the last digit (omitted when 0); zero is `0`. Each decimal
    /// value has exactly one such spelling.
    fn number(&mut self) -> Result<(), Invalid> {
        let input = self.input;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let int_start = self.pos;
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => self.skip_digits(),
            _ => return Err(Invalid),
        }
        let int = &input[int_start..self.pos];
        let mut frac: &[u8] = &[];
        if self.peek() == Some(b'.') {
            self.pos += 1;
            let frac_start = self.pos;
            self.skip_digits();
            frac = &input[frac_start..self.pos];
            if frac.is_empty() {
                return Err(Invalid);
            }
        }
        let mut exponent: i64 = 0;
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            let exp_negative = match self.peek() {
                Some(b'-') => {
                    self.pos += 1;
                    true
                }
                Some(b'+') => {
                    self.pos += 1;
                    false
                }
                _ => false,
            };
            let exp_start = self.pos;
            self.skip_digits();
            if exp_start == self.pos {
                return Err(Invalid);
            }
            for &d in &input[exp_start..self.pos] {
                exponent = exponent
                    .checked_mul(10)
                    .and_then(|e| e.checked_add(i64::from(d - b'0')))
                    .ok_or(Invalid)?;
            }
            if exp_negative {
                exponent = -exponent;
            }
        }
        // After a leading `0` JSON allows no further integer digit (`01` is not a number).
        if let Some(b'0'..=b'9') = self.peek() {
            return Err(Invalid);
        }

        let out = &mut self.s.out;
        if frac.is_empty() && exponent == 0 && int.last().is_some_and(|&d| d != b'0') {
            // The common integer: its sign and digits are already canonical (a written zero
            // exponent such as `e+0` is dropped).
            out.extend_from_slice(&input[int_start - usize::from(negative)..int_start + int.len()]);
            return Ok(());
        }
        let is_zero = |b: &u8| *b == b'0';
        let int_lead = int.iter().position(|b| !is_zero(b));
        let frac_lead = frac.iter().position(|b| !is_zero(b));
        if int_lead.is_none() && frac_lead.is_none() {
            out.push(b'0');
            return Ok(());
        }
        if negative {
            out.push(b'-');
        }
        // Trailing zeros move into the exponent.
        let trailing;
        match frac.iter().rposition(|b| !is_zero(b)) {
            Some(last) => {
                trailing = frac.len() - 1 - last;
                if let Some(lead) = int_lead {
                    out.extend_from_slice(&int[lead..]);
                    out.extend_from_slice(&frac[..=last]);
                } else if let Some(lead) = frac_lead {
                    out.extend_from_slice(&frac[lead..=last]);
                }
            }
            None => {
                let lead = int_lead.ok_or(Invalid)?;
                let last = int.iter().rposition(|b| !is_zero(b)).ok_or(Invalid)?;
                trailing = frac.len() + (int.len() - 1 - last);
                out.extend_from_slice(&int[lead..=last]);
            }
        }
        let shift = i64::try_from(trailing).map_err(|_| Invalid)?
            - i64::try_from(frac.len()).map_err(|_| Invalid)?;
        let exponent = exponent.checked_add(shift).ok_or(Invalid)?;
        if exponent != 0 {
            out.push(b'e');
            push_i64(out, exponent);
        }
        Ok(())
    }

    fn skip_digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }
}

/// Pushes onto `stack` the pointers of `active` that continue through `matches` at `depth`;
/// returns whether one of them ends there (the child is removed) and the range pushed.
fn descend(
    stack: &mut Vec<usize>,
    pointers: &[Pointer],
    depth: usize,
    active: &std::ops::Range<usize>,
    matches: impl Fn(&Token) -> bool,
) -> (bool, std::ops::Range<usize>) {
    let start = stack.len();
    let mut removed = false;
    for i in active.clone() {
        let index = stack[i];
        let tokens = &pointers[index].tokens;
        if matches(&tokens[depth]) {
            if tokens.len() == depth + 1 {
                removed = true;
            } else {
                stack.push(index);
            }
        }
    }
    (removed, start..stack.len())
}

fn push_i64(out: &mut Vec<u8>, value: i64) {
    if value < 0 {
        out.push(b'-');
    }
    let mut magnitude = value.unsigned_abs();
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        // `magnitude % 10` is below 10, so the cast cannot truncate.
        digits[at] = b'0' + (magnitude % 10) as u8;
        magnitude /= 10;
        if magnitude == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// Reads a string body from just after its opening quote through its closing quote, writing
/// its characters to `dest`: canonically escaped when `canonical`, else unescaped UTF-8.
fn string(
    input: &[u8],
    pos: &mut usize,
    dest: &mut Vec<u8>,
    canonical: bool,
) -> Result<(), Invalid> {
    loop {
        let start = *pos;
        *pos = scan_plain(input, start);
        // Plain bytes are their own canonical spelling; the input is known to be UTF-8.
        dest.extend_from_slice(&input[start..*pos]);
        match input.get(*pos) {
            Some(b'"') => {
                *pos += 1;
                return Ok(());
            }
            Some(b'\\') => {
                // These escapes are already their canonical spelling: copied, not decoded.
                if canonical
                    && let Some(&e @ (b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't')) =
                        input.get(*pos + 1)
                {
                    dest.extend_from_slice(&[b'\\', e]);
                    *pos += 2;
                    continue;
                }
                *pos += 1;
                let c = escape(input, pos)?;
                if canonical {
                    encode_char(c, dest);
                } else {
                    let mut buf = [0u8; 4];
                    dest.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
            _ => return Err(Invalid),
        }
    }
}

/// The position of the first quote, backslash or control byte at or after `pos` (or the end).
fn scan_plain(input: &[u8], mut pos: usize) -> usize {
    // Eight bytes at a time: a byte of `word` is flagged in `special` when it equals `"` or `\`
    // or is below 0x20. Borrows can flag bytes above a real match but never below one, so the
    // lowest flag is exact.
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    while let Some(chunk) = input.get(pos..pos + 8) {
        let Ok(bytes) = <[u8; 8]>::try_from(chunk) else {
            break;
        };
        let word = u64::from_le_bytes(bytes);
        let quote = word ^ (ONES * u64::from(b'"'));
        let backslash = word ^ (ONES * u64::from(b'\\'));
        let special = (quote.wrapping_sub(ONES) & !quote)
            | (backslash.wrapping_sub(ONES) & !backslash)
            | (word.wrapping_sub(ONES * 0x20) & !word);
        let special = special & HIGHS;
        if special != 0 {
            return pos + (special.trailing_zeros() / 8) as usize;
        }
        pos += 8;
    }
    while let Some(&b) = input.get(pos) {
        if STRING_SPECIAL[usize::from(b)] {
            break;
        }
        pos += 1;
    }
    pos
}

/// Decodes the escape after a backslash.
fn escape(input: &[u8], pos: &mut usize) -> Result<char, Invalid> {
    let b = *input.get(*pos).ok_or(Invalid)?;
    *pos += 1;
    Ok(match b {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let first = hex4(input, pos)?;
            let code = match first {
                0xd800..=0xdbff => {
                    // A lone surrogate is no character and has no UTF-8 form: refused.
                    if input.get(*pos..*pos + 2) != Some(b"\\u") {
                        return Err(Invalid);
                    }
                    *pos += 2;
                    let second = hex4(input, pos)?;
                    if !(0xdc00..=0xdfff).contains(&second) {
                        return Err(Invalid);
                    }
                    0x10000 + ((first - 0xd800) << 10) + (second - 0xdc00)
                }
                0xdc00..=0xdfff => return Err(Invalid),
                _ => first,
            };
            char::from_u32(code).ok_or(Invalid)?
        }
        _ => return Err(Invalid),
    })
}

fn hex4(input: &[u8], pos: &mut usize) -> Result<u32, Invalid> {
    let digits = input.get(*pos..*pos + 4).ok_or(Invalid)?;
    let mut value = 0;
    for &d in digits {
        let nibble = char::from(d).to_digit(16).ok_or(Invalid)?;
        value = value * 16 + nibble;
    }
    *pos += 4;
    Ok(value)
}

/// Writes unescaped UTF-8 `text` with the canonical escaping.
fn encode_string(text: &[u8], out: &mut Vec<u8>) {
    let mut start = 0;
    for (i, &b) in text.iter().enumerate() {
        if STRING_SPECIAL[usize::from(b)] {
            out.extend_from_slice(&text[start..i]);
            encode_char(char::from(b), out);
            start = i + 1;
        }
    }
    out.extend_from_slice(&text[start..]);
}

/// The one canonical spelling of a character: `\"`, `\\`, the short escapes for the controls
/// that have one, `\u00xx` for the other controls, and the character itself otherwise.
fn encode_char(c: char, out: &mut Vec<u8>) {
    match c {
        '"' => out.extend_from_slice(b"\\\""),
        '\\' => out.extend_from_slice(b"\\\\"),
        '\u{8}' => out.extend_from_slice(b"\\b"),
        '\u{c}' => out.extend_from_slice(b"\\f"),
        '\n' => out.extend_from_slice(b"\\n"),
        '\r' => out.extend_from_slice(b"\\r"),
        '\t' => out.extend_from_slice(b"\\t"),
        c if u32::from(c) < 0x20 => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            let code = u32::from(c) as usize;
            out.extend_from_slice(b"\\u00");
            out.push(HEX[code >> 4]);
            out.push(HEX[code & 0xf]);
        }
        c => {
            let mut buf = [0u8; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(json: &str, ignored: &[&str]) -> Option<String> {
        let pointers: Vec<Pointer> = ignored.iter().map(|p| Pointer::parse(p)).collect();
        let mut scratch = Scratch::default();
        canonicalise(json.as_bytes(), &pointers, &mut scratch).ok()?;
        Some(String::from_utf8(scratch.out).unwrap())
    }

    #[test]
    fn numbers_have_one_spelling_per_decimal_value() {
        let table = [
            ("7e+0", "7"),
            ("-7E0", "-7"),
            ("10000000000001e-0", "10000000000001"),
            ("12.5", "125e-1"),
            ("12.50", "125e-1"),
            ("1.25e1", "125e-1"),
            ("125E-1", "125e-1"),
            ("0.125e+2", "125e-1"),
            ("-12.5", "-125e-1"),
            ("12.500000001", "12500000001e-9"),
            ("0", "0"),
            ("-0", "0"),
            ("0.0", "0"),
            ("0e5", "0"),
            ("-0.000E-7", "0"),
            ("100", "1e2"),
            ("1", "1"),
            ("10.0", "1e1"),
            ("1.0", "1"),
            ("0.001", "1e-3"),
            ("1e9223372036854775807", "1e9223372036854775807"),
            ("120e-1", "12"),
        ];
        for (input, expected) in table {
            assert_eq!(canon(input, &[]).as_deref(), Some(expected), "{input}");
        }
    }

    #[test]
    fn exponents_that_overflow_are_invalid() {
        assert_eq!(canon("1e9223372036854775808", &[]), None);
        assert_eq!(canon("1e-99999999999999999999", &[]), None);
        // The exponent itself fits but shifting by the fraction's length does not.
        assert_eq!(canon("0.01e-9223372036854775807", &[]), None);
    }

    #[test]
    fn huge_exponents_cost_nothing() {
        assert_eq!(
            canon("5e1000000000000", &[]).as_deref(),
            Some("5e1000000000000")
        );
    }

    #[test]
    fn malformed_numbers_are_invalid() {
        for input in [
            "01", "1.", ".5", "-", "1e", "1e+", "+1", "0x10", "1.5.2", "--1", "NaN",
        ] {
            assert_eq!(canon(input, &[]), None, "{input}");
        }
    }

    #[test]
    fn strings_are_reescaped_canonically() {
        assert_eq!(canon(r#""\u0041""#, &[]).as_deref(), Some(r#""A""#));
        assert_eq!(canon(r#""\/""#, &[]).as_deref(), Some(r#""/""#));
        assert_eq!(canon(r#""\u000a\n""#, &[]).as_deref(), Some(r#""\n\n""#));
        assert_eq!(canon(r#""\u001f""#, &[]).as_deref(), Some(r#""\u001f""#));
        assert_eq!(canon(r#""\ud83d\ude00""#, &[]).as_deref(), Some("\"😀\""));
        assert_eq!(canon(r#""\"\\""#, &[]).as_deref(), Some(r#""\"\\""#));
        assert_eq!(canon("\"é\"", &[]).as_deref(), Some("\"é\""));
    }

    #[test]
    fn escapes_copied_as_sent_agree_with_decoded_ones() {
        assert_eq!(
            canon(r#""a\"\\\b\f\n\r\tz""#, &[]).as_deref(),
            Some(r#""a\"\\\b\f\n\r\tz""#)
        );
        assert_eq!(
            canon(r#""\u0022\u005c\u0008\u000c\u000A\u000d\u0009\/""#, &[]).as_deref(),
            Some(r#""\"\\\b\f\n\r\t/""#)
        );
        // In a key the escapes are decoded, so the two spellings collide.
        assert_eq!(canon(r#"{"\n":1,"\u000a":2}"#, &[]), None);
        assert_eq!(
            canon(r#"{"\t":1,"\n":2}"#, &[]).as_deref(),
            Some(r#"{"\t":1,"\n":2}"#)
        );
        for input in [r#""\"#, r#""\""#, r#""\n"#, r#""\q""#] {
            assert_eq!(canon(input, &[]), None, "{input}");
        }
    }

    #[test]
    fn malformed_strings_are_invalid() {
        for input in [
            r#""abc"#,
            "\"a\nb\"",
            r#""\x""#,
            r#""\u12""#,
            r#""\ud83d""#,
            r#""\ude00""#,
            r#""\ud83d\u0041""#,
        ] {
            assert_eq!(canon(input, &[]), None, "{input}");
        }
        let mut scratch = Scratch::default();
        assert!(canonicalise(b"\"\xff\"", &[], &mut scratch).is_err());
    }

    #[test]
    fn objects_are_sorted_by_unescaped_key() {
        assert_eq!(
            canon(r#"{ "b" : 1, "a" : [ 2 , {"d":null,"c":true} ] }"#, &[]).as_deref(),
            Some(r#"{"a":[2,{"c":true,"d":null}],"b":1}"#)
        );
        // `\u0062` is `b`, which sorts after `a` even though `\` sorts after both.
        assert_eq!(
            canon(r#"{"\u0062":1,"a":2}"#, &[]).as_deref(),
            Some(r#"{"a":2,"b":1}"#)
        );
        assert_eq!(
            canon(r#"{"\"":1,"!":2}"#, &[]).as_deref(),
            Some(r#"{"!":2,"\"":1}"#)
        );
    }

    #[test]
    fn objects_sort_alike_whatever_text_precedes_them() {
        // Short and long text before an unsorted object: it is sorted in a buffer of its own
        // then, or in place.
        assert_eq!(
            canon(r#"{"b":{"d":1,"c":2},"a":0}"#, &[]).as_deref(),
            Some(r#"{"a":0,"b":{"c":2,"d":1}}"#)
        );
        assert_eq!(
            canon(r#"["a long string before the object",{"b":1,"a":2}]"#, &[]).as_deref(),
            Some(r#"["a long string before the object",{"a":2,"b":1}]"#)
        );
        assert_eq!(
            canon(
                r#"[{"y":[{"q":1,"p":2}],"x":0},{"d":"\u0041","c":{"f":1,"e":2},"t":9}]"#,
                &["/1/t", "/0/y/0/p"]
            )
            .as_deref(),
            Some(r#"[{"x":0,"y":[{"q":1}]},{"c":{"e":2,"f":1},"d":"A"}]"#)
        );
    }

    #[test]
    fn duplicate_keys_are_invalid() {
        assert_eq!(canon(r#"{"a":1,"a":1}"#, &[]), None);
        assert_eq!(canon(r#"{"a":1,"b":2,"\u0061":3}"#, &[]), None);
    }

    #[test]
    fn structural_errors_are_invalid() {
        for input in [
            "",
            " ",
            "{",
            "}",
            "[1,]",
            "{\"a\":1,}",
            "{\"a\"}",
            "{a:1}",
            "[1 2]",
            "tru",
            "nul",
            "true false",
            "{\"a\":1}x",
            "\u{feff}{}",
        ] {
            assert_eq!(canon(input, &[]), None, "{input:?}");
        }
    }

    #[test]
    fn nesting_is_limited_without_stack_overflow() {
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(canon(&ok, &[]).is_some());
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert_eq!(canon(&deep, &[]), None);
        let hostile = "{\"a\":".repeat(1_000_000);
        assert_eq!(canon(&hostile, &[]), None);
    }

    #[test]
    fn ignored_pointers_remove_members_and_elements() {
        let json =
            r#"{"b":1,"meta":{"trace_id":"t","keep":[1,2,3]},"request_time":"x","a/b":0,"m~n":0}"#;
        assert_eq!(
            canon(
                json,
                &[
                    "/request_time",
                    "/meta/trace_id",
                    "/meta/keep/1",
                    "/a~1b",
                    "/m~0n"
                ]
            )
            .as_deref(),
            Some(r#"{"b":1,"meta":{"keep":[1,3]}}"#)
        );
        assert_eq!(
            canon(
                json,
                &["request_time", "/missing", "/meta/keep/9", "/b/deeper"]
            )
            .as_deref(),
            Some(r#"{"a/b":0,"b":1,"meta":{"keep":[1,2,3],"trace_id":"t"},"m~n":0}"#)
        );
    }

    #[test]
    fn ignored_members_are_still_validated() {
        assert_eq!(canon(r#"{"t":[1,}"#, &["/t"]), None);
        assert_eq!(canon(r#"{"t":1,"t":2}"#, &["/t"]), None);
    }

    #[test]
    fn array_index_tokens_follow_rfc_6901() {
        assert_eq!(array_index("0"), Some(0));
        assert_eq!(array_index("12"), Some(12));
        assert_eq!(array_index("012"), None);
        assert_eq!(array_index("-"), None);
        assert_eq!(array_index(""), None);
        assert_eq!(canon("[1,2]", &["/01"]).as_deref(), Some("[1,2]"));
        assert_eq!(
            canon(r#"{"01":1,"1":2}"#, &["/01"]).as_deref(),
            Some(r#"{"1":2}"#)
        );
    }

    #[test]
    fn pointer_unescapes_tilde_one_before_tilde_zero() {
        assert_eq!(
            canon(r#"{"~1":1,"/":2}"#, &["/~01"]).as_deref(),
            Some(r#"{"/":2}"#)
        );
    }

    proptest::proptest! {
        #[test]
        fn word_scan_finds_the_first_special_byte(
            bytes in proptest::collection::vec(proptest::prop_oneof![
                proptest::prelude::any::<u8>(),
                proptest::prelude::Just(b'"'),
                proptest::prelude::Just(b'\\'),
                proptest::prelude::Just(b'a'),
            ], 0..40),
            start in 0usize..40,
        ) {
            let start = start.min(bytes.len());
            let naive = bytes[start..]
                .iter()
                .position(|&b| STRING_SPECIAL[usize::from(b)])
                .map_or(bytes.len(), |i| start + i);
            proptest::prop_assert_eq!(scan_plain(&bytes, start), naive);
        }
    }

    #[test]
    fn scratch_buffers_are_reused_across_calls() {
        let pointers = [Pointer::parse("/a/x")];
        let first = with_canonical(br#"{"b":[1,2],"a":{"x":1,"y":2}}"#, &pointers, |c| {
            c.cloned()
        });
        let second = with_canonical(br#"{"a":{"y":2},"b":[1,2]}"#, &pointers, |c| c.cloned());
        assert_eq!(first, second);
        assert!(with_canonical(b"{", &pointers, |c| c.is_none()));
    }
}
