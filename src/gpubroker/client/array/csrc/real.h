// Helpers of one real type R (F32, F64): Python's floor division and remainder (NumPy's divmod), logaddexp,
// clip. A helper is copied into a source only where the kernel names it (client/array/_csource.py).
FN R R_floordiv(R a, R b) {
  R mod = fmod(a, b);
  if (b == (R)0 || isinf(a) || isinf(b)) return a / b;  /* the standard's infinities: +-inf, +-0 or NaN */
  R div = (a - mod) / b;
  if (mod != (R)0) { if ((b < (R)0) != (mod < (R)0)) div -= (R)1; }
  R fl;
  if (div != (R)0) { fl = floor(div); if (div - fl > (R)0.5) fl += (R)1; }
  else { fl = copysign((R)0, a / b); }
  return fl;
}
FN R R_rem(R a, R b) {
  R mod = fmod(a, b);
  if (b == (R)0) return mod;
  if (mod != (R)0) { if ((b < (R)0) != (mod < (R)0)) mod += b; }
  else { mod = copysign((R)0, b); }
  return mod;
}
FN R R_logaddexp(R a, R b) {
  if (a == b) return a + (R)0.693147180559945309417232121458176568;
  R d = a - b;
  return d > (R)0 ? a + log1p(exp(-d)) : (d <= (R)0 ? b + log1p(exp(d)) : d);
}
FN R R_clip(R x, R lo, R hi) {
  if (isnan(lo)) return lo;
  if (isnan(hi)) return hi;
  R r = x < lo ? lo : x;
  return r > hi ? hi : r;
}
