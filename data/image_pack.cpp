// Writing (multi-threaded re-encode, atomic) and reading (mmap, checked) packed image files.
#include "data/image_pack.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>

#include "core/byte_reader.h"
#include "core/checksum.h"
#include "core/errors.h"

namespace replica::data {

namespace {
constexpr char kMagic[] = "RPLPACK1";
constexpr uint32_t kVersion = 1;
constexpr size_t kEntryBytes = 8 + 4 + 4 + 2 + 2;

template <typename T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// One image re-encoded: decoded, shrunk so the shorter side is at most max_side, JPEG again.
std::string reencode(const FolderDataset& src, int64_t i, const PackOptions& o, uint16_t& w, uint16_t& h) {
  std::string storage;
  const std::string_view b = src.bytes(i, storage);
  const std::string name = src.source(i);
  int fw = 0, fh = 0;
  image_size(b, name, fw, fh);
  const double s = std::min(1.0, static_cast<double>(o.max_side) / std::min(fw, fh));
  const int ow = std::max(1, static_cast<int>(std::lround(fw * s))), oh = std::max(1, static_cast<int>(std::lround(fh * s)));
  const RgbImage img = decode_image(b, name, ow, oh);
  std::vector<float> f(static_cast<size_t>(ow) * oh * 3);
  resample(img, {0, 0, static_cast<double>(fw), static_cast<double>(fh)}, ow, oh, false, f.data());
  std::vector<uint8_t> px(f.size());
  for (size_t k = 0; k < f.size(); ++k) px[k] = static_cast<uint8_t>(std::clamp(std::lround(f[k] * 255.f), 0L, 255L));
  if (ow > 65535 || oh > 65535) throw IoError(name + ": too large to pack (" + std::to_string(ow) + "x" + std::to_string(oh) + ")");
  w = static_cast<uint16_t>(ow);
  h = static_cast<uint16_t>(oh);
  return encode_jpeg(px.data(), ow, oh, o.quality);
}
}  // namespace

size_t pack_images(const FolderDataset& src, const std::string& out_path, const PackOptions& o) {
  const std::string tmp = out_path + ".tmp." + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw IoError(out_path + ": cannot write (" + std::strerror(errno) + ")");
  const int64_t n = src.size();
  std::string head = kMagic;
  head.resize(8);
  put<uint32_t>(head, kVersion);
  put<uint32_t>(head, static_cast<uint32_t>(src.class_names().size()));
  put<uint64_t>(head, static_cast<uint64_t>(n));
  const size_t fixups = head.size();
  put<uint64_t>(head, 0);  // index offset, known at the end
  put<uint64_t>(head, 0);  // index checksum
  for (const auto& c : src.class_names()) {
    put<uint32_t>(head, static_cast<uint32_t>(c.size()));
    head += c;
  }
  std::string index;
  uint64_t at = head.size();
  bool ok = std::fwrite(head.data(), 1, head.size(), f) == head.size();
  const int threads = std::max(1, o.threads);
  const int64_t chunk = 64 * threads;
  try {
    for (int64_t lo = 0; lo < n && ok; lo += chunk) {
      const int64_t hi = std::min(n, lo + chunk);
      std::vector<std::string> blobs(static_cast<size_t>(hi - lo));
      std::vector<std::pair<uint16_t, uint16_t>> dims(blobs.size());
      std::vector<std::exception_ptr> errs(static_cast<size_t>(threads));
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          try {
            for (int64_t i = lo + t; i < hi; i += threads)
              blobs[static_cast<size_t>(i - lo)] = reencode(src, i, o, dims[static_cast<size_t>(i - lo)].first,
                                                            dims[static_cast<size_t>(i - lo)].second);
          } catch (...) {
            errs[static_cast<size_t>(t)] = std::current_exception();
          }
        });
      for (auto& t : ts) t.join();
      for (auto& e : errs)
        if (e) std::rethrow_exception(e);
      for (size_t k = 0; k < blobs.size(); ++k) {
        ok = ok && std::fwrite(blobs[k].data(), 1, blobs[k].size(), f) == blobs[k].size();
        put<uint64_t>(index, at);
        put<uint32_t>(index, static_cast<uint32_t>(blobs[k].size()));
        put<int32_t>(index, src.label(lo + static_cast<int64_t>(k)));
        put<uint16_t>(index, dims[k].first);
        put<uint16_t>(index, dims[k].second);
        at += blobs[k].size();
      }
      if (o.progress) o.progress(hi, n);
    }
    ok = ok && std::fwrite(index.data(), 1, index.size(), f) == index.size();
    const uint64_t index_offset = at, sum = fnv1a(index.data(), index.size());
    ok = ok && std::fseek(f, static_cast<long>(fixups), SEEK_SET) == 0 && std::fwrite(&index_offset, 8, 1, f) == 1 &&
         std::fwrite(&sum, 8, 1, f) == 1;
    ok = ok && std::fflush(f) == 0 && fsync(fileno(f)) == 0;
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), out_path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw IoError(out_path + ": writing the pack failed (" + std::strerror(errno) + "); nothing was replaced");
  }
  return static_cast<size_t>(at + index.size());
}

void write_image_folder(const Dataset& ds, const std::string& dir, int size, int quality, int threads, bool png) {
  const Shape s = ds.sample_shape();
  const int H = static_cast<int>(s[0]), W = static_cast<int>(s[1]), C = static_cast<int>(s[2]);
  const int S = size > 0 ? size : 0;
  const int digits = static_cast<int>(std::to_string(std::max<int64_t>(1, ds.classes() - 1)).size());
  auto label_dir = [&](int32_t l) {
    std::string n = std::to_string(l);
    return dir + "/" + std::string(static_cast<size_t>(std::max(0, digits - static_cast<int>(n.size()))), '0') + n;
  };
  for (int32_t l = 0; l < ds.classes(); ++l) std::filesystem::create_directories(label_dir(l));
  const int64_t n = ds.size();
  std::vector<std::thread> ts;
  std::vector<std::exception_ptr> errs(static_cast<size_t>(std::max(1, threads)));
  for (int t = 0; t < std::max(1, threads); ++t)
    ts.emplace_back([&, t] {
      try {
        std::vector<float> f(static_cast<size_t>(H) * W * C);
        std::vector<uint8_t> rgb(static_cast<size_t>(H) * W * 3);
        for (int64_t i = t; i < n; i += std::max(1, threads)) {
          const int32_t label = ds.get(i, f.data());
          for (size_t p = 0; p < static_cast<size_t>(H) * W; ++p)
            for (int c = 0; c < 3; ++c)
              rgb[3 * p + c] = static_cast<uint8_t>(std::clamp(std::lround(f[p * C + (C == 3 ? c : 0)] * 255.f), 0L, 255L));
          std::string jpeg;
          if (S && (S != W || S != H)) {
            RgbImage img;
            img.width = img.full_width = W;
            img.height = img.full_height = H;
            img.pixels = rgb;
            std::vector<float> r(static_cast<size_t>(S) * S * 3);
            resample(img, {0, 0, static_cast<double>(W), static_cast<double>(H)}, S, S, false, r.data());
            std::vector<uint8_t> px(r.size());
            for (size_t k = 0; k < r.size(); ++k) px[k] = static_cast<uint8_t>(std::clamp(std::lround(r[k] * 255.f), 0L, 255L));
            jpeg = png ? encode_png(px.data(), S, S, 3) : encode_jpeg(px.data(), S, S, quality);
          } else {
            jpeg = png ? encode_png(rgb.data(), W, H, 3) : encode_jpeg(rgb.data(), W, H, quality);
          }
          FILE* f2 = std::fopen((label_dir(label) + "/" + std::to_string(i) + (png ? ".png" : ".jpg")).c_str(), "wb");
          if (!f2 || std::fwrite(jpeg.data(), 1, jpeg.size(), f2) != jpeg.size() || std::fclose(f2) != 0)
            throw IoError(dir + ": cannot write images there (" + std::strerror(errno) + ")");
        }
      } catch (...) {
        errs[static_cast<size_t>(t)] = std::current_exception();
      }
    });
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

PackIndex parse_pack(std::string_view bytes, const std::string& source) {
  if (bytes.size() < 40 || bytes.substr(0, 8) != std::string_view(kMagic, 8))
    throw IoError(source + ": not a replica image pack (bad magic or too short); make one with `replica pack`");
  ByteReader in(bytes, source);
  in.take(8, "the magic");
  const uint32_t version = in.get<uint32_t>("the version");
  if (version != kVersion)
    throw IoError(source + ": pack version " + std::to_string(version) + ", this replica reads version " +
                  std::to_string(kVersion) + "; pack the images again with this replica");
  const uint32_t classes = in.get<uint32_t>("the class count");
  const uint64_t images = in.get<uint64_t>("the image count");
  const uint64_t index_offset = in.get<uint64_t>("the index offset");
  const uint64_t sum = in.get<uint64_t>("the index checksum");
  if (classes == 0 || classes > 1000000) throw IoError(source + ": " + std::to_string(classes) + " classes (damaged header)");
  PackIndex p;
  for (uint32_t c = 0; c < classes; ++c) {
    const uint32_t len = in.get<uint32_t>("a class name's length");
    if (len > 4096) throw IoError(source + ": a class name of " + std::to_string(len) + " bytes (damaged header)");
    p.classes.emplace_back(in.take(len, "a class name"));
  }
  const uint64_t data_start = bytes.size() - in.remaining();
  if (images > (bytes.size() / kEntryBytes) || index_offset < data_start || index_offset > bytes.size() ||
      bytes.size() - index_offset != images * kEntryBytes)
    throw IoError(source + ": the index does not fit the file (" + std::to_string(bytes.size()) +
                  " bytes): truncated or damaged; pack the images again");
  const std::string_view index = bytes.substr(index_offset);
  if (fnv1a(index.data(), index.size()) != sum) throw IoError(source + ": index checksum mismatch: the file is damaged");
  ByteReader ix(index, source);
  for (uint64_t i = 0; i < images; ++i) {
    PackIndex::Item it;
    it.offset = ix.get<uint64_t>("an index entry");
    it.size = ix.get<uint32_t>("an index entry");
    it.label = ix.get<int32_t>("an index entry");
    it.width = ix.get<uint16_t>("an index entry");
    it.height = ix.get<uint16_t>("an index entry");
    if (it.offset < data_start || it.offset > index_offset || it.size > index_offset - it.offset || it.label < 0 ||
        static_cast<uint32_t>(it.label) >= classes)
      throw IoError(source + ": index entry " + std::to_string(i) + " points outside the images or to no class");
    p.items.push_back(it);
  }
  return p;
}

PackedDataset::PackedDataset(const std::string& path, ImageRecipe recipe, std::string name)
    : name_(std::move(name)), path_(path) {
  recipe_ = recipe;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(path + ": cannot open the pack (" + std::strerror(errno) + ")");
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    ::close(fd);
    throw IoError(path + ": empty or unreadable pack");
  }
  map_size_ = static_cast<size_t>(st.st_size);
  void* m = mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) throw IoError(path + ": cannot map the pack (" + std::strerror(errno) + ")");
  map_ = static_cast<const char*>(m);
  try {
    const PackIndex p = parse_pack(std::string_view(map_, map_size_), path);
    class_names_ = p.classes;
    for (const auto& it : p.items) {
      entries_.push_back({it.offset, it.size});
      labels_.push_back(it.label);
    }
  } catch (...) {
    munmap(const_cast<char*>(map_), map_size_);
    throw;
  }
}

PackedDataset::~PackedDataset() {
  if (map_) munmap(const_cast<char*>(map_), map_size_);
}

std::string_view PackedDataset::bytes(int64_t i, std::string&) const {
  const Entry& e = entries_[static_cast<size_t>(i)];
  return std::string_view(map_ + e.offset, e.size);
}

}  // namespace replica::data
